"""The front door stays true: README.md is short, every relative link in the README, BENCHMARKS.md and
docs/ reaches a file (and a heading, when it names one), every `quantdyn ...` line in their shell blocks
names a real command and real, visible options, and the README's Python example uses only the public API."""
import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 210
IMAGE_MAX_BYTES = 300_000

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code spans (their brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _blocks(text: str, langs: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (underscores and hyphens kept), spaces to
    hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def links(page: Path) -> list[tuple[bool, str]]:
    return [(bang == "!", target) for bang, target in LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to a page under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert links(page) or page.name == "BENCHMARKS.md", f"{page.name} links nowhere"
    broken = []
    for image, target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if image and dest.stat().st_size > IMAGE_MAX_BYTES:
            broken.append(f"{target}: {dest.stat().st_size} bytes, more than {IMAGE_MAX_BYTES}")
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_follows_github():
    assert slug("A(a): decayed endpoints vs constant-LR controls") == "aa-decayed-endpoints-vs-constant-lr-controls"
    assert slug("What a field means: `quantdyn.results.schema`") == "what-a-field-means-quantdynresultsschema"
    assert slug("Several processes: DDP and FSDP2") == "several-processes-ddp-and-fsdp2"
    assert slug("A(a) on a GPU (`configs/studies/cooldown_gpu.yaml`)") == "aa-on-a-gpu-configsstudiescooldown_gpuyaml"


def _command_lines(text: str) -> list[list[str]]:
    """The argument lists after `quantdyn` (or `-m quantdyn.cli`) in the page's shell blocks; optional parts
    written as [--json] count as given."""
    out = []
    for body in _blocks(text, ("bash", "sh", "console")):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            starts = [i + 1 for i, w in enumerate(words)
                      if w == "quantdyn" or (w == "quantdyn.cli" and i and words[i - 1] == "-m")]
            if starts:
                out.append([w.strip("[]") for w in words[starts[0]:] if w.strip("[]")])
    return out


@pytest.fixture(scope="module")
def cli():
    import typer

    from quantdyn.cli import app
    return typer.main.get_command(app)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_lines_name_real_commands_and_options(page, cli):
    wrong = []
    for args in _command_lines(page.read_text()):
        cmd, rest = cli, list(args)
        while rest and getattr(cmd, "commands", None) and rest[0] in cmd.commands:
            cmd = cmd.commands[rest.pop(0)]
        if cmd is cli:
            if rest and not rest[0].startswith("-"):
                wrong.append(f"quantdyn {' '.join(args)}: no command '{rest[0]}'")
            continue
        visible = {o for p in cmd.params if not getattr(p, "hidden", False) for o in (*p.opts, *p.secondary_opts)}
        for w in rest:
            flag = w.split("=", 1)[0]
            if flag.startswith("-") and not flag[1:].isdigit() and flag not in visible | {"-h", "--help"}:  # -100: a value
                wrong.append(f"quantdyn {' '.join(args)}: '{cmd.name}' has no option {flag}")
    assert not wrong, "\n".join(wrong)


def test_command_line_parser_sees_every_kind_of_line():
    text = ("```bash\nquantdyn sweep SPEC.yaml --shard 0/4   # a comment --not-an-option\n"
            "torchrun --nproc_per_node 2 -m quantdyn.cli train configs/tiny.yaml dist.strategy=fsdp2\n"
            "WANDB_MODE=offline quantdyn results [--json] \\\n    --store x\n```\n")
    assert _command_lines(text) == [["sweep", "SPEC.yaml", "--shard", "0/4"],
                                    ["train", "configs/tiny.yaml", "dist.strategy=fsdp2"],
                                    ["results", "--json", "--store", "x"]]


def test_python_blocks_parse_and_the_readme_uses_only_the_public_api():
    import quantdyn.api as qd

    for page in PAGES:
        for body in _blocks(page.read_text(), ("python",)):
            ast.parse(body, filename=str(page))
    (example,) = _blocks(README.read_text(), ("python",))
    used = {n.attr for n in ast.walk(ast.parse(example))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "qd"}
    assert used and used <= set(qd.__all__), used - set(qd.__all__)
    assert len(example.strip().splitlines()) <= 12


@pytest.mark.e2e
def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch):
    """The README's example, word for word, in a directory laid out as `make demo` leaves it: a run's
    checkpoint at runs/demo/checkpoints/step-0000600 (here a tiny run's last one) and a store in results/."""
    import quantdyn.api as qd

    cfg = qd.from_dict(qd.RunConfig, {
        "name": "tiny", "out_dir": str(tmp_path / "train"), "seed": 0,
        "model": {"n_layer": 2, "d_model": 64, "n_head": 2, "max_seq_len": 256},
        "data": {"source": "builtin:kjv", "tokenizer": "bpe:512", "max_tokens": 200_000, "bpe_train_chars": 400_000},
        "schedule": {"name": "wsd", "warmup": 2, "decay": 4},
        "train": {"steps": 8, "batch_size": 4, "seq_len": 64, "eval_every": 0, "eval_windows": 4,
                  "checkpoint_every": 4, "log_every": 4}})
    run = qd.train(cfg, progress=False, overwrite=True)
    (tmp_path / "runs" / "demo" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "checkpoints" / "step-0000600").symlink_to(run / "checkpoints" / "step-0000008")
    qd.run_sweep(qd.from_dict(qd.SweepConfig, {
        "trajectory": {"run": str(run)}, "quantizers": ["rtn3"], "store": str(tmp_path / "results"),
        "data": {"calib_samples": 4, "calib_seq_len": 64, "eval_windows": 8, "eval_seq_len": 64}}), progress=False)
    monkeypatch.chdir(tmp_path)
    (example,) = _blocks(README.read_text(), ("python",))
    printed = []
    exec(compile(example, "README.md", "exec"), {"print": lambda *a, **k: printed.append(" ".join(map(str, a)))})
    assert printed[0].startswith("gptq3: Δ CE ") and printed[1].startswith("rtn4: Δ CE ")
    assert "rtn3" in printed[2] and "main" in printed[2]
