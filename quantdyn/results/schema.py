"""The result rows: which kinds the store holds, what every field means, how a row is keyed, and the
quantities every reader derives from a row the same way.

A row is one JSON object in the store (``results/store.py`` owns the files). This module is the one place
to look a field up: :data:`ROW_KINDS` lists the kinds (``ptq``, ``fp``, ``qat``, ``analysis``,
``accuracy``, ``interpolation``, ``scaling``) with their fields, :data:`FIELDS` says what each field
means, and :func:`describe` answers for one name (``describe("delta_ce_total_se").meaning``).

Row kinds are code: each kind is a constant here (:data:`PTQ`, :data:`FP`, :data:`QAT`, :data:`ANALYSIS`,
:data:`ACCURACY`, :data:`INTERPOLATION`, :data:`SCALING`, each a :class:`RowKind` in ROW_KINDS). A writer
puts ``"kind": PTQ.name`` in its row; a reader asks ``PTQ.matches(row)``, ``PTQ.select(rows)`` or
``PTQ.present(rows)``, never compares ``row["kind"]`` with a string.

Reading rules (every reader keeps them, so old stores stay readable):
  * only ``key`` and ``kind`` are sure to be there; any other field may be missing from rows written
    before it existed (``window_delta``, ``eval_hash``, ``quant_repeats``, ``delta_ce_total_se``,
    ``decaying`` ...). Read fields with ``row.get(name)`` (None when absent), never ``row[name]``, unless
    the row kind has always had them (a ptq row's ``delta_ce``, ``ce_fp``, ``tokens``).
  * a stored number is read with :func:`number`: a finite real number, or None for anything else
    (missing, null, a bool, text, NaN, ±inf). NaN is what a writer stores for a quantity it could not
    define (the SE of one window), so "not a finite number" and "not measured" read the same.
  * fields are only ever added; a field keeps its name and meaning (the writers' job).

Keys: :func:`row_key` is the idempotency key of a measured row, a hash of (checkpoint, what was
measured, evaluation windows); :func:`calib_hash` names a calibration set. A rerun skips every key
already stored.

Branch names (the ``branch`` field) are run-directory names: ``quantdyn.runs`` owns them
(``cooldown_branch``, ``control_branch``, ``parse_branch``, ``control_of``).

Schema describes, :mod:`quantdyn.results.stats` computes: what is derived from a row (rel_delta_ce, the combined
uncertainty of a Δ CE and its parts) is computed there.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from quantdyn.errors import QuantdynError, did_you_mean
from quantdyn.registry import Registry

# ------------------------------------------------------------------ the field table


@dataclass(frozen=True)
class Field:
    """One field of a result row."""

    name: str
    """The field's name in the row; ``<...>`` marks a part that varies (``prop_R_final__<quantizer>``)."""
    type: str
    """Its JSON type as Python spells it (``float``, ``int | None``, ``list[float]``, ``dict`` ...)."""
    meaning: str
    """What it is, with its unit."""


def _table(text: str) -> tuple[Field, ...]:
    """Fields from a text table, a field a line: name, type and meaning, separated by two or more spaces (a
    name has none, a type and a meaning single ones); an indented line continues the meaning above it."""
    out: list[list[str]] = []
    for line in text.strip("\n").splitlines():
        line = line[4:]
        if line.startswith(" "):
            out[-1][2] += " " + line.strip()
        else:
            out.append(re.split(r" {2,}", line.strip(), maxsplit=2))
    return tuple(Field(*f) for f in out)


IDENTITY_FIELDS = _table("""
    key   str  Idempotency key (row_key for measured rows): a rerun skips every key already stored.
    kind  str  The row kind (ROW_KINDS): ptq, fp, qat, analysis, accuracy, interpolation, scaling,
               sensitivity, ship or decision.
""")
PROVENANCE_FIELDS = _table("""
    git_sha   str | None  git commit of quantdyn that wrote the row.
    hardware  str         Machine that computed it (CPU model, GPU).
    time      str         Local time the row was computed, YYYY-MM-DDTHH:MM:SS.
""")
CHECKPOINT_FIELDS = _table("""
    run              str           Training run (its directory name, or the hub repo of a public trajectory).
    branch           str           Branch of the run: main, a cooldown or control branch (runs.cooldown_branch), an
                                   average (lawa-..., ema, soup-...), an ingredient or an interpolation.
    ckpt_kind        str           What the checkpoint is: checkpoint (main run), cooldown, control, lawa, ema,
                                   soup, hub ...
    checkpoint       str           Where the checkpoint was read: a directory, or repo@revision.
    checkpoint_hash  str           Content hash of the checkpoint's weights.
    step             int | None    Optimizer step of the checkpoint.
    tokens           int | None    Training tokens seen at the checkpoint.
    lr               float | None  Learning rate at the checkpoint's step.
    decaying         bool | None   Whether the LR is in a decay phase at the checkpoint (None: unknown).
    peak_lr          float | None  The run's peak learning rate.
    seed             int | None    The run's seed (initialisation and data order).
    parent_step      int | None    Step of the main-run checkpoint a branch starts from (None on main).
    optimizer        str | None    The run's optimizer name.
    weight_decay     float | None  The run's weight decay.
    qat              str | None    Quantization-aware training of the run, e.g. quest-w4a4, or the format of format
                                   QAT (rtn4, nvfp4: a QAT cooldown branch) (None: full precision).
    n_params         int           Non-embedding parameters of the model.
    weight_grid_levels  float | None  Median distinct values per 32-weight block (input dim) of the FP block
                                   weights, median over the quantizable tensors (analysis/grid.py): ~32 for
                                   float-trained weights, <= 16 for weights dequantized from a 4-bit format.
    weight_grid      str | None    "4-bit grid" (the bits of that median) when it is at most 24: the weights are
                                   already quantized underneath, every error is relative to that grid; None else.
    preset           str | None    Public-trajectory preset the checkpoint comes from.
    family           str | None    Model family of the preset (pythia, olmo, ...).
    phase            str | None    Schedule phase of a preset checkpoint (warmup, stable, decay ...).
    revision         str | None    Hub revision of a preset checkpoint.
    stage            str | None    Training stage of a preset checkpoint (OLMo-2 stage 1/2).
    ingredient       str | None    Which stage-2 ingredient (soup member) a preset checkpoint is.
""")
DATA_FIELDS = _table("""
    eval_hash      str         Identity of the evaluation windows (token data, sequence length, count): rows with
                               equal eval_hash were measured on the same windows and pair window by window.
    calib_hash     str | None  Identity of the calibration set (calib_hash()).
    data_key       str         Hash of the token data the windows were drawn from.
    n_windows      int         Evaluation windows the CE values average.
    compute_dtype  str         dtype the measurement computed in.
    measurement    str | None  Identity of the measurement the row's numbers come from: row_key of (the weights'
                               checkpoint_hash, what was measured, eval_hash), without the checkpoint's place in a
                               trajectory, so rows of identical weights (a cooldown experiment's branch point, step 0
                               of every branch) share it; distinct values count measurements. Sweep rows only.
    copy_of        str | None  Key of the row whose measurement this row repeats: the same weights at another place
                               of the trajectory, measured once (sweep/sweep.py); its own place (run, branch, step,
                               checkpoint) is this row's, its numbers and provenance the measured row's. Absent on
                               a measured row.
""")
QUANTIZER_FIELDS = _table("""
    quantizer          str | None   Canonical quantizer label (gptq3, rtn4g64 ...): one spelling per configuration.
    quantizer_spec     str          The quantizer as the user wrote it.
    method             str          Quantization method: rtn, gptq, awq, or a deployment format (q4_k_m, q8_0,
                                    fp8, fp8_channel, w8a8_fp8, nf4, mxfp4, nvfp4 ...; quantize/formats.py)
                                    (qat-<method> on qat rows).
    bits               int          Weight bits.
    group_size         int          Quantization group size (0: per channel).
    quant_config       dict | None  The full quantizer config.
    quant_config_hash  str | None   Hash of quant_config; rows are keyed by it, never by a label.
    bits_per_weight    float | None  Storage bits per quantized weight with its scales, as the format stores them
                                    (GGUF blocks, FP8/E8M0/E4M3 scales, NF4's double-quantized absmax; integer
                                    grids as a packed GPTQ checkpoint), averaged over the quantized layers
                                    weighted by size (the head too when quantized).
    format_fallbacks   dict | None  GGUF tensors whose rows did not fit their block type and took llama.cpp's
                                    fallback type: {layer: "q4_K->q5_0"}; None when none did.
    rotation           str | None   Rotation before quantizing (docs/rotations.md): had (every quantized layer's input,
                                    label +had), r1 (the residual stream, +r1) or had+r1; absent on unrotated rows.
    rotation_seed      int | None   Seed of the rotation's random signs (label +seed<N>; 0 by default).
""")
ERRORS_FIELDS = _table("""
    ce_fp                 float         Mean next-token cross-entropy of the full-precision model on the evaluation
                                        windows (nats).
    ce_fp_se              float         SE of ce_fp over windows (window-to-window spread; not a paired SE).
    ce_q                  float         Mean CE of the quantized model on the same windows (nats).
    delta_ce              float         Δ CE = CE(quantized) − CE(FP), paper A's quantization error (nats); with R >
                                        1 repeats the mean over them.
    delta_ce_se           float         Paired SE of delta_ce over evaluation windows (SE_eval).
    rel_delta_ce          float | None  Δ CE / CE(FP) (results.stats.rel_delta_ce for rows written before the field).
    delta_ppl             float         exp CE(quantized) − exp CE(FP).
    kl                    float         KL(P_FP ‖ P_Q) per token (nats), mean over windows.
    kl_se                 float         SE of kl over windows.
    top1_agree            float         Fraction of tokens whose top-1 prediction is the same in both models
                                        (llama.cpp's "same top p"; exact ties count as agreement since the
                                        detailed measures, top_k_agreement).
    ppl_ratio             float | None  PPL(Q) / PPL(FP) = exp(delta_ce). Its logarithm, llama.cpp's
                                        "ln(PPL(Q)/PPL(base))", is delta_ce itself (not stored twice).
    ppl_ratio_se          float | None  ppl_ratio × delta_ce_se (delta method, as llama.cpp).
    kl_median             float | None  Median over all evaluated tokens of the per-token KL(P_FP ‖ P_Q) (nats);
                                        percentiles interpolate linearly between order statistics (numpy's
                                        default, llama.cpp's percentile).
    kl_p90                float | None  90th percentile of the per-token KL(P_FP ‖ P_Q).
    kl_p99                float | None  99th percentile of the per-token KL(P_FP ‖ P_Q).
    kl_p999               float | None  99.9th percentile of the per-token KL(P_FP ‖ P_Q).
    kl_max                float | None  Largest per-token KL(P_FP ‖ P_Q).
    kl_reverse            float | None  KL(P_Q ‖ P_FP) per token (nats), mean over windows.
    kl_reverse_se         float | None  SE of kl_reverse over windows.
    top<2|3|4|5>_agree    float | None  Top-K agreement: fraction of tokens whose K most probable tokens under Q
                                        are FP's K most probable, in the same order (exllamav3 model_diff's
                                        "top-K agreement"; K = 1 is top1_agree). Exact ties count as
                                        agreement.
    top<1|2|3|4|5>_agree_se  float | None  SE over windows of the top-K agreement.
    delta_p               float | None  Mean over tokens of Δp = P_Q(y) − P_FP(y), the correct next token's
                                        probability change (llama.cpp's "Mean Δp", as a fraction, not %).
    delta_p_se            float | None  SE of delta_p over windows (paired: Δp is a per-token difference).
    delta_p_rms           float | None  RMS of Δp over tokens (llama.cpp's "RMS Δp").
    delta_p_rms_se        float | None  SE of delta_p_rms: the SE over windows of the mean Δp², / (2 RMS).
    delta_p_p1            float | None  1st percentile of Δp over tokens.
    delta_p_p99           float | None  99th percentile of Δp over tokens.
    logprob_corr          float | None  Pearson correlation over tokens of ln P_FP(y) and ln P_Q(y) (llama.cpp's
                                        "Cor(ln(PPL(Q)), ln(PPL(base)))"); no SE (not a mean).
    kl_by_confidence      list[float | None]  Mean KL(P_FP ‖ P_Q) of the tokens in each bucket of FP's top-1
                                        probability, buckets [0, .25), [.25, .5), [.5, .75), [.75, .95),
                                        [.95, 1] (exllamav3's; evaluate/quant_error.CONFIDENCE_EDGES); None
                                        for an empty bucket.
    confidence_fraction   list[float]   Fraction of the evaluated tokens in each bucket of kl_by_confidence.
    n_tokens              int | None    Evaluated tokens (n_windows × tokens per window) the per-token
                                        percentiles, correlation and histogram are over.
    block_rel_fro         list[float]   Per block: relative Frobenius error ‖H_Q − H_FP‖_F / ‖H_FP‖_F of the
                                        block's output hidden states on each evaluation window, mean over
                                        windows (exllamav3 model_diff; quantdyn/evaluate/quant_error.py
                                        HiddenError). Block 0 first.
    block_cos_err         list[float]   Per block: 1 − cosine similarity of each token's output hidden state
                                        with FP's, mean over tokens.
    block_sqnr            list[float]   Per block: SQNR of each token's output hidden state,
                                        10·log10(‖h_FP‖² / (‖h_Q − h_FP‖² + 1e-8)) dB, mean over tokens.
    within_noise_floor    bool | None   Whether delta_ce sits inside the checkpoint's bf16 noise floor: Δ CE −
                                        floor_delta_ce is at most 2 paired SEs (results/stats.py
                                        within_noise_floor); None when no floor was measured.
    delta_ce_floor_z      float | None  z of Δ CE − floor_delta_ce, paired over windows (None: no floor).
    window_delta          list[float]   Per-window Δ CE (7 decimals), in window order: what paired differences pair.
    window_kl             list[float]   Per-window mean KL(FP ‖ Q) (7 significant digits), in window order: pairs KLs.
    quant_repeats         int           R, how many times the quantization was repeated (1 when absent).
    repeat_vary           str | None    What changed between repeats: draw (calibration windows), order, both.
    delta_ce_repeats      list[float]   Δ CE of each repeat (R > 1 only).
    delta_ce_run_sd       float | None  SD of Δ CE over the R repeats: what re-quantizing changes (None when R = 1).
    kl_run_sd             float         SD of kl over the R repeats (R > 1 only).
    delta_ce_total_se     float         The combined uncertainty of delta_ce, sqrt(SE_eval² + SD_run²/R)
                                        (results.stats.Uncertainty).
    uncertainty_dominant  str           Which part of delta_ce_total_se is the larger: 'evaluation windows' or
                                        'quantization run'.
    layer_loss_sum        float | None  Sum over layers of the quantizer's own layer objective (GPTQ's loss).
    n_calibration         int           Calibration sequences the quantizer saw.
    t_quantize            float         Seconds spent quantizing (all repeats).
    t_eval                float         Seconds spent evaluating, this quantizer's share.
    t_load                float         Seconds spent opening the checkpoint.
    eval_group            int           Quantizers measured in one pass with this one.
    t_<read|convert|capture|calib_forward|quantize_layers|diagnostics|eval_forward|head|total>  float  Seconds
                                        of the whole measurement (all eval_group quantizers together) in one
                                        engine phase (quantdyn/engine/phases.py); total: the whole call.
    calib_batch_size      int           Calibration batch size.
    quantize_threads      int           CPU threads while quantizing (0: on an accelerator).
""")
FLOOR_METRICS = ("ce_q", "delta_ce", "delta_ce_se", "rel_delta_ce", "delta_ppl", "ppl_ratio", "ppl_ratio_se", "kl",
                 "kl_se", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "kl_reverse", "kl_reverse_se",
                 "top1_agree", *(f"top{k}_agree" for k in range(2, 6)), *(f"top{k}_agree_se" for k in range(1, 6)),
                 "delta_p", "delta_p_se",
                 "delta_p_rms", "delta_p_rms_se", "delta_p_p1", "delta_p_p99", "logprob_corr", "kl_by_confidence",
                 "confidence_fraction", "n_windows", "n_tokens", "window_delta", "window_kl", "block_rel_fro",
                 "block_cos_err",
                 "block_sqnr")
"""The error fields a noise floor carries (as ``floor_<field>`` in the fp row)."""
FLOOR_FIELDS = (
    Field("floor_rounding", "str | None",
          "What the checkpoint's noise floor rounded: 'bf16 weights and block outputs' (float32/float16 compute; "
          "with a bf16 checkpoint the weight rounding is a no-op and the floor is the bf16 rounding of the block "
          "outputs), or, with bf16 compute (where that rounding changes nothing), 'float32 blocks, bf16 block "
          "outputs': the floor is then the bf16 arithmetic inside the blocks (engine/noise_floor.py). None/absent: "
          "no floor measured."),
    Field("floor_<" + "|".join(FLOOR_METRICS) + ">", "as the field",
          "The noise floor of the checkpoint: the error field of the same name (a ptq row's) for the FP model "
          "against itself with bf16 rounding injected after every block (floor_rounding), measured in the same "
          "pass as ce_fp, stored once per checkpoint in its fp row; the band of every trajectory figure."),
)
QUANTIZE_COMMAND_FIELDS = _table("""
    calib_data     str         Calibration token source of `quantdyn quantize`.
    calib_samples  int         Calibration sequences of `quantdyn quantize`.
    calib_seq_len  int         Their length in tokens.
    eval_data      str         Evaluation token source of `quantdyn quantize`.
    streams        str         Where the engine kept its activation streams (memory, disk).
    layers         list[dict]  Per-layer quantization diagnostics (loss, output error, condition ...).
    export         dict        The export written: format, path (and hub repo).
""")
QAT_FIELDS = _table("""
    a_bits  int  Activation bits of the deployed QAT model (0: full-precision activations).
""")
ANALYSIS_FIELDS = _table("""
    analysis                     str           Which analysis: hessian, outliers, propagation or curvature.
    hessian_trace                float         Hutchinson estimate of the trace of the Hessian of the held-out loss.
    hessian_trace_se             float         SE of hessian_trace over the Hutchinson probes.
    hessian_trace_probes         int           Probes used.
    hessian_top_eig              float | None  Top Hessian eigenvalue (power iteration; no SE).
    hessian_seconds              float         Seconds the Hessian analysis took.
    n_layers                     int           Linear layers the outlier metrics aggregate.
    weight_<metric>_<mean|max>   float         Weight outlier metric (mmr, kurtosis, excess_kurtosis, max_abs), mean
                                               or max over linear layers.
    act_<metric>_<mean|max>      float         Input-activation outlier metric (mmr, mmr_token, kurtosis,
                                               excess_kurtosis, max_abs) on calibration tokens, mean or max over
                                               layers.
    prop_R_final__<quantizer>    float         Paper B's R_L: the propagated relative output error after the last
                                               block.
    prop_gain_mean__<quantizer>  float | None  Mean per-block gain of the propagated error.
    prop_B_sum__<quantizer>      float         New error introduced per block, summed over blocks.
    curvature_along_update       float | None  The early warning: curvature u^T H u of the held-out loss along the
                                               update from the checkpoint's predecessor, u its unit direction
                                               (None: it has none).
    curvature_from               str           The predecessor checkpoint (the run's previous one, a branch's branch
                                               point), or why there is none.
    update_norm                  float | None  |w - w_prev|, the norm of that update.
    curvature_from_step          int | None    The predecessor's step.
    curvature_from_hash          str           The predecessor's weights' hash (part of the row's key).
    curvature_slope              float | None  The loss's first derivative along the update's direction.
    curvature_h                  float | None  The finite-difference step (1e-2 x |w|).
    curvature_windows            int           Held-out windows the three losses are evaluated on.
    curvature_seconds            float | None  Seconds the curvature took (both loads included).
""")
ACCURACY_FIELDS = _table("""
    task             str               lm-eval task (or a built-in generated task).
    task_version     str | int | None  The task's version.
    task_data        str               Built-in tasks: hash of the token data they were generated from.
    task_seed        int               Built-in tasks: generation seed.
    task_n           int               Built-in tasks: examples generated.
    task_files_hash  str               Built-in tasks: hash of the generated files.
    metric           str               The task metric (acc, acc_norm ...).
    n                int               Examples scored.
    num_fewshot      int               Few-shot examples.
    limit            int | None        Example limit (None: all).
    backend          str               Which evaluator ran the task.
    lm_eval_version  str | None        lm-eval's version.
    acc_fp           float             Accuracy of the full-precision model.
    acc_fp_se        float             Its SE over examples.
    acc_q            float | None      Accuracy of the quantized model (None on an FP-only row).
    acc_q_se         float | None      Its SE over examples.
    acc_drop         float | None      acc_fp − acc_q, paired over examples.
    acc_drop_se      float | None      Paired SE of acc_drop.
    metrics_fp       dict              lm-eval's aggregate metrics of the FP model.
    metrics_q        dict              lm-eval's aggregate metrics of the quantized model.
    sweep_acc_key    str               Marks accuracy rows a sweep wrote for one (checkpoint, quantizer).
""")
INTERPOLATION_FIELDS = _table("""
    alpha       float  interpolation rows: the weight of endpoint B, (1 − alpha)·A + alpha·B; scaling rows: the
                       fitted exponent α of N.
    endpoint_a  str    Checkpoint A.
    endpoint_b  str    Checkpoint B.
""")
SCALING_FIELDS = _table("""
    by                         str         The grouping of the fit (optimizer).
    group                      str         The group's value.
    precision                  str         fp or qat: which losses were fitted.
    A                          float       Scaling law L = A·(ρN)^−α + B·D^−β + E: A.
    B                          float       B.
    beta                       float       β.
    E                          float       E, the irreducible loss.
    rho                        float       ρ, the effective-parameter multiplier of the precision.
    objective                  float       The fit's final objective.
    n_points                   int         Points fitted.
    <A|alpha|B|beta|E|rho>_lo  float       Lower end of the bootstrap interval of a fitted parameter.
    <A|alpha|B|beta|E|rho>_hi  float       Upper end of the bootstrap interval of a fitted parameter.
    points                     list[dict]  The (N, D, loss) points fitted.
""")

PLAN_FIELDS = _table("""
    plan_types                  dict | None   A per-tensor plan's type of every quantized layer ({layer: type}).
    plan_label                  str | None    auto@ quantizers: the plan they allocated on this checkpoint (plan:auto#<digest>).
    plan_digest                 str | None    Digest of that plan's assignment.
    plan_bits_per_weight        float | None  Its bits per weight as planned (the row's bits_per_weight is the measured).
    plan_predicted_kl           float | None  The allocator's additive prediction of the mean KL per token.
    plan_predicted_kl_joint     float | None  The sensitivity pass's prediction of the plan with the tensors'
                                              interactions.
    plan_predicted_kl_joint_se  float | None  Its SE over the sensitivity windows.
    plan_allocator              str | None    knapsack-dp (exact) or lagrangian+greedy (quantize/allocate.py).
    t_sensitivity               float | None  Seconds of the sensitivity pass the allocation used.
""")
SENSITIVITY_FIELDS = _table("""
    scope                 str           What one sensitivity row quantizes: tensor (one linear), group (a block's
                                        attn or mlp linears together) or model (every linear at one type).
    tensor                str           The linear's full name, the group (<block>.attn / <block>.mlp) or all.
    block                 int | None    Its decoder block (None for the whole model).
    tensor_group          str           attn, mlp, other or all.
    layer_path            str           The linear's path inside its block.
    type                  str           The candidate type (a quantizer label, or f16).
    n_weights             int           Weights quantized.
    kl_pred               float         Predicted mean KL(FP ‖ Q) per sensitivity token when only these weights are
                                        quantized at this type (engine/sensitivity.py: sampled Fisher).
    kl_pred_se            float         Its SE over the sensitivity windows.
    kl_pred_additive      float | None  Group and model rows: the sum of their tensors' own kl_pred (no interactions).
    layer_loss            float | None  ½ tr(ΔW H ΔWᵀ) with the FP input statistics (the cheap proxy).
    fisher_diag           float | None  ½ Σ F_ii ΔW_i² per token with the diagonal Fisher (the other proxy).
    rho_layer_loss        float | None  Model rows: Spearman of layer_loss with kl_pred over every tensor and type.
    rho_fisher_diag       float | None  Model rows: Spearman of fisher_diag with kl_pred over every tensor and type.
    rho_layer_loss_type   float | None  Model rows: Spearman of layer_loss with kl_pred across tensors at this type.
    rho_fisher_diag_type  float | None  Model rows: Spearman of fisher_diag with kl_pred across tensors at this type.
    sens_tokens           int           Tokens of the sensitivity windows (the calibration windows).
    sens_draws            int           Labels drawn per sequence.
    sens_seconds          float         Seconds of the whole sensitivity pass of this checkpoint.
    sens_types            list[str]     The candidate types of the pass.
""")
SHIP_FIELDS = _table("""
    ship_candidate     str           The candidate's name in its ship (main/step-600, lawa-k3, soup-decayed ...).
    ship_recipe        str           How the candidate was made: checkpoint, cooldown, control, ema, lawa or soup.
    ship_quantization  str           The quantization as ship names it: a type label (q4_0, gptq4) or auto@BUDGET.
    ship_stage         str           screen (the first windows, every option) or full (the other windows, the
                                     options the screen kept).
    ship_windows       list[int]     [first, end) of the evaluation windows this row measured.
    window_ce_q        list[float]   Per-window CE of the quantized model (FP window CE + window_delta, 7
                                     decimals), in window order: what ship pairs across candidates.
    plan_file          str | None    auto@ quantizations: the plan file the screen allocated, measured on the other
                                     windows and exported.
    plan_stability     dict | None   auto@ with repeats R >= 2: draws, n_tensors, changed_tensors (per draw, against
                                     draw 0's plan), predicted_kl and its sd, kl (measured) and its sd,
                                     bits_per_weight per draw, floor_kl (the bf16 noise floor's KL).
    ship               dict          A decision row: ship.json as written (artifact, quantizer, ce_q, tied, naive,
                                     gain, export, commands ...; docs/ship.md).
""")

GROUPS: tuple[tuple[Field, ...], ...] = (
    IDENTITY_FIELDS, PROVENANCE_FIELDS, CHECKPOINT_FIELDS, DATA_FIELDS, QUANTIZER_FIELDS, ERRORS_FIELDS, FLOOR_FIELDS,
    QUANTIZE_COMMAND_FIELDS, QAT_FIELDS, ANALYSIS_FIELDS, ACCURACY_FIELDS, INTERPOLATION_FIELDS, SCALING_FIELDS,
    PLAN_FIELDS, SENSITIVITY_FIELDS, SHIP_FIELDS)
FIELDS: dict[str, Field] = {f.name: f for group in GROUPS for f in group}
"""Every field of every row kind, by name."""


def _names(*groups: tuple[Field, ...], only: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(f.name for g in groups for f in g) + only


@dataclass(frozen=True)
class RowKind:
    """One kind of result row: what it is, and the one spelling of its ``kind``, which writers put in a row
    (``"kind": PTQ.name``) and readers match on (:meth:`matches`, :meth:`select`, :meth:`present`)."""

    name: str
    """The row's ``kind``."""
    meaning: str
    """What one row of this kind is."""
    written_by: str
    """The module(s) that write it."""
    key: str
    """How its key is made (the ``what`` of row_key)."""
    fields: tuple[str, ...]
    """The fields it may carry (names in FIELDS)."""

    def matches(self, row: Mapping) -> bool:
        """Whether ``row`` is of this kind."""
        return row.get("kind") == self.name

    def select(self, rows: Iterable[Mapping]) -> list:
        """The rows of this kind, in their order."""
        return [r for r in rows if r.get("kind") == self.name]

    def present(self, rows: Iterable[Mapping]) -> bool:
        """Whether any of ``rows`` is of this kind."""
        return any(r.get("kind") == self.name for r in rows)


_MEASURED = (IDENTITY_FIELDS, PROVENANCE_FIELDS, CHECKPOINT_FIELDS, DATA_FIELDS)
ROW_KINDS: Registry[RowKind] = Registry("row kind")
"""The row kinds the store holds, by name; each is also a constant here (PTQ, FP, ...) that writers build rows
with and readers match on. A new kind is one more ``ROW_KINDS.add(name, RowKind(...))`` below (with its field
group in GROUPS)."""

PTQ = ROW_KINDS.add("ptq", RowKind(
    "ptq", "One quantizer applied to one checkpoint: its error against full precision on the evaluation windows "
           "(R repeats of the quantization averaged when quant_repeats > 1).",
    "sweep/sweep.py, sweep/quantize_one.py (engine/rows.py ptq_fields)",
    "row_key(checkpoint, ptq_what = 'ptq:<config hash>:<calib hash>[:R<R>:<vary>]', eval_hash)",
    _names(*_MEASURED, QUANTIZER_FIELDS, ERRORS_FIELDS, QUANTIZE_COMMAND_FIELDS, PLAN_FIELDS)))
FP = ROW_KINDS.add("fp", RowKind(
    "fp", "The full-precision CE of one checkpoint on the evaluation windows, and its bf16 noise floor "
          "(floor_<field>, when measured).", "sweep/sweep.py (engine/rows.py floor_fields)",
    "row_key(checkpoint, 'fp', eval_hash)", _names(*_MEASURED, FLOOR_FIELDS, only=("ce_fp", "ce_fp_se"))))
QAT = ROW_KINDS.add("qat", RowKind(
    "qat", "A QAT run's checkpoint deployed with its own fake quantization (W and A), against FP.",
    "sweep/sweep.py", "row_key(checkpoint, 'qat:<config hash>', eval_hash)",
    _names(*_MEASURED, QUANTIZER_FIELDS, ERRORS_FIELDS, QAT_FIELDS)))
ANALYSIS = ROW_KINDS.add("analysis", RowKind(
    "analysis", "One analysis of one checkpoint: Hessian, outlier, propagation or curvature-along-the-update metrics.",
    "sweep/sweep.py (sweep/analysis_rows.py)",
    "row_key(checkpoint, 'analysis:<name>:<budget hash>[:<quantizers hash>][:<predecessor hash>]', eval_hash)",
    _names(*_MEASURED, ANALYSIS_FIELDS)))
ACCURACY = ROW_KINDS.add("accuracy", RowKind(
    "accuracy", "Downstream accuracy of one task, FP and (optionally) one quantizer, paired over examples.",
    "sweep/accuracy.py", "accuracy_row_key(checkpoint, task, version, task identity, few-shot, limit, seed, "
                         "quantizer hash, calib hash, metric, backend)",
    _names(*_MEASURED, QUANTIZER_FIELDS, ACCURACY_FIELDS)))
INTERPOLATION = ROW_KINDS.add("interpolation", RowKind(
    "interpolation", "A checkpoint on the line between two endpoints (weight interpolation): FP CE, and a PTQ "
                     "error per quantizer.", "sweep/interpolation.py",
    "row_key(interpolated checkpoint, 'interp:<alpha>|fp' or 'interp:<alpha>|<ptq_what>', eval_hash)",
    _names(*_MEASURED, QUANTIZER_FIELDS, ERRORS_FIELDS, INTERPOLATION_FIELDS)))
SCALING = ROW_KINDS.add("scaling", RowKind(
    "scaling", "A scaling-law fit of FP or QAT losses over model sizes and token budgets.",
    "studies/scaling.py", "sha256 of (group, precision, the fitted points)",
    _names(IDENTITY_FIELDS, PROVENANCE_FIELDS, SCALING_FIELDS, only=("alpha",))))
SENSITIVITY = ROW_KINDS.add("sensitivity", RowKind(
    "sensitivity", "One checkpoint's predicted KL when one linear (scope tensor), one tensor group (group) or every "
                   "linear (model) is quantized at one candidate type, with the cheap proxies.",
    "sweep/sweep.py, sweep/allocate_one.py (engine/sensitivity.py Sensitivity.rows)",
    "row_key(checkpoint, 'sens:<types>:<calib hash>:<draws>:<scope>:<tensor>:<type>', '')",
    _names(*_MEASURED, SENSITIVITY_FIELDS)))
SHIP = ROW_KINDS.add("ship", RowKind(
    "ship", "One candidate x quantization measured by `quantdyn ship` on one slice of the evaluation windows: the "
            "ptq fields, and the per-window CE of the quantized model that ship pairs across candidates.",
    "ship/ship.py (engine/rows.py ptq_fields)",
    "row_key(weights hash, 'ship:' + ptq_what, eval_hash + '[first:end]')",
    _names(*_MEASURED, QUANTIZER_FIELDS, ERRORS_FIELDS, QUANTIZE_COMMAND_FIELDS, PLAN_FIELDS, SHIP_FIELDS)))
DECISION = ROW_KINDS.add("decision", RowKind(
    "decision", "What `quantdyn ship` decided to deploy at a budget (its ship.json), read by the report's first "
                "section, What to ship.", "ship/ship.py",
    "sha256 of (the request, the chosen candidate and quantizer)",
    _names(IDENTITY_FIELDS, PROVENANCE_FIELDS, only=("ship", "checkpoint", "checkpoint_hash", "eval_hash",
                                                     "data_key"))))


def _pattern(name: str) -> re.Pattern:
    """``<a|b>`` in a field name stands for a or b, any other ``<...>`` for any text."""
    parts = re.split(r"(<[^>]*>)", name)
    return re.compile("^" + "".join(
        ("(?:" + "|".join(map(re.escape, p[1:-1].split("|"))) + ")" if "|" in p else ".+") if p.startswith("<")
        else re.escape(p) for p in parts) + "$")


_PATTERNS = [(_pattern(n), f) for n, f in FIELDS.items() if "<" in n]
"""The varying fields (``prop_R_final__<quantizer>``) as patterns."""


def describe(name: str) -> Field:
    """The field called ``name`` (a varying one matches its pattern: ``prop_R_final__gptq3``)."""
    f = FIELDS.get(name)
    if f is not None:
        return f
    for pat, f in _PATTERNS:
        if pat.match(name):
            return f
    raise QuantdynError(f"no result-row field '{name}'{did_you_mean(name, FIELDS)}; "
                        "quantdyn.results.schema.FIELDS lists them")


def undocumented(row: dict) -> list[str]:
    """The fields of ``row`` that the schema does not describe for its kind: not in FIELDS, or (for a known
    ``kind``) not among that kind's fields — a writer added a field without saying what it is."""
    kind = ROW_KINDS.get(row["kind"]) if row.get("kind") in ROW_KINDS else None
    out = []
    for k in row:
        try:
            f = describe(k)
        except QuantdynError:
            out.append(k)
            continue
        if kind is not None and f.name not in kind.fields:
            out.append(k)
    return out


# ------------------------------------------------------------------ keys


def row_key(ckpt_hash: str, what: str, eval_hash: str) -> str:
    """Idempotency key of a measured row: sha256 of ``checkpoint|what|eval windows``, 24 hex digits.

    ``what`` names the measurement (``fp``, ``ptq:<config hash>:<calib hash>``, ``interp:<alpha>|...``,
    ``analysis:...``; ROW_KINDS gives each kind's)."""
    return hashlib.sha256(f"{ckpt_hash}|{what}|{eval_hash}".encode()).hexdigest()[:24]


def calib_hash(data_hash: str, samples: int, seq_len: int, seed: int) -> str:
    """Identity of a calibration set drawn from a token cache (``TokenData.calib_windows``): sha1, 12 hex digits."""
    return hashlib.sha1(f"{data_hash}:{samples}:{seq_len}:{seed}".encode()).hexdigest()[:12]


# ------------------------------------------------------------------ reading numbers


def number(v) -> float | None:
    """A stored value as a number: a finite real (int or float, numpy scalars included) as float; None for
    anything else — missing, null, a bool, text, NaN or ±inf (see the module docstring)."""
    if v is None or isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    f = float(v)
    return f if math.isfinite(f) else None
