"""Upload an exported checkpoint directory to the Hugging Face Hub (``--push-to-hub REPO``)."""
from __future__ import annotations

import json
from pathlib import Path

from quantdyn.errors import QuantdynError


def push_to_hub(export_dir: str | Path, repo_id: str, *, private: bool | None = None, revision: str | None = None,
                commit_message: str | None = None, token: str | None = None) -> str:
    """Create ``repo_id`` (a model repo) if needed and upload ``export_dir`` into it; return the commit URL.

    The directory must be a finished export (config.json with a quantization_config). Every failure --
    offline mode (HF_HUB_OFFLINE=1), no network, no or a read-only token, a bad repo name -- ends in one
    QuantdynError line that says what to fix.
    """
    export_dir = Path(export_dir)
    cfg = export_dir / "config.json"
    if not cfg.is_file():
        raise QuantdynError(f"'{export_dir}' has no config.json; push a directory written by --export")
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config")
    except json.JSONDecodeError:
        raise QuantdynError(f"'{cfg}' is not valid JSON; re-run the export") from None
    if not qc:
        raise QuantdynError(f"'{export_dir}' is not a quantized export (config.json has no quantization_config)")
    if not isinstance(repo_id, str) or repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise QuantdynError(f"hub repo '{repo_id}' is not a repo id; write NAME or OWNER/NAME")
    import huggingface_hub  # function-local: only pushing needs the hub client's network stack
    from huggingface_hub.utils import HfHubHTTPError

    try:
        from huggingface_hub.errors import OfflineModeIsEnabled
    except ImportError:  # older huggingface_hub
        from huggingface_hub.utils import OfflineModeIsEnabled  # type: ignore[no-redef]

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise QuantdynError(f"cannot push to the Hugging Face Hub repo '{repo_id}': offline mode is on "
                            f"(HF_HUB_OFFLINE=1); unset it on a machine with network access")
    try:
        api = huggingface_hub.HfApi(token=token)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(export_dir), repo_id=repo_id, repo_type="model", revision=revision,
                                 commit_message=commit_message or f"quantdyn export ({qc.get('quant_method')})")
    except OfflineModeIsEnabled:
        raise QuantdynError(f"cannot push to the Hugging Face Hub repo '{repo_id}': offline mode is on "
                            f"(HF_HUB_OFFLINE=1); unset it on a machine with network access") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise QuantdynError(f"cannot push to the Hugging Face Hub repo '{repo_id}': {first} — check the network, "
                            f"your token (`hf auth login` or HF_TOKEN, with write access) and the repo name") from None
    return str(getattr(info, "commit_url", info))
