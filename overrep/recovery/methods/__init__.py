"""Recovery methods: OverRep and the baselines it is compared with, behind one interface.

Every method starts from the same pruned model (built by the pipeline from one plan),
trains with the same :class:`~overrep.recovery.trainer.Trainer` (AdamW, cosine schedule, clipping,
checkpoints, exact resume) and ends as the same kind of output: a plain, compact Hugging
Face model. A method only decides *what* trains and *which* objective it minimises.

=============  ===============================================  ======================
method         what trains                                      objective
=============  ===============================================  ======================
overrep        recovery blocks, overcomplete (``recovery.preset``)  layer-wise (``recovery.loss``)
plain          the same recovery blocks without W, D, annealing     layer-wise (``recovery.loss``)
streamline     one block replaces the removed run (all weights)     layer-wise (``recovery.loss``)
lora           PEFT LoRA on every projection of every block          language modelling
adalora        PEFT AdaLoRA (rank re-allocated every step)           language modelling
lora-iso       LoRA whose rank matches OverRep's trainable count     language modelling
rankadaptor    LoRA, per-block ranks (mean r) a performance-model    language modelling
               search chose (RankAdaptor)
full-ft        every retained block, all weights                     language modelling
logit-kd       every retained block, all weights                     KL to dense logits
overrep-kd     OverRep's recovery blocks                             KL to dense logits
overrep-lm     OverRep's recovery blocks                             language modelling
restorelcc     2 x head_dim vectors on the attention heads a probe   language modelling
               found pruning hurt most (RestoreLCC), merged as o bias
replaceme      nothing: a least-squares map per removed run, folded  (closed form)
               (also replaceme-cos, prunecomp: :mod:`.closed_form`)
linearpatch    nothing (-kd: the patch, one pass): a d x d patch    (reference; not
               at each gap, an extra module (:mod:`.patch`)          exportable)
=============  ===============================================  ======================

One module per family: :mod:`.layerwise` (overrep, plain, streamline), :mod:`.adapters`
(lora, adalora, lora-iso; rankadaptor's search in :mod:`.rankadaptor`), :mod:`.whole_model`
(full-ft, logit-kd, overrep-kd, overrep-lm), :mod:`.restorelcc` (restorelcc; its probe in
:mod:`.restorelcc_probe`), :mod:`.closed_form` (replaceme, replaceme-cos, prunecomp) and
:mod:`.patch` (linearpatch, linearpatch-kd); what they share is in :mod:`.base`. A method receives a
:class:`~overrep.recovery.teacher.MethodInputs`
(models, plan, data, its config section, the teacher) and nothing else.

Streamline (Chen et al., 2024) replaces the pruned run with one trained layer; here that
layer is the retained block just before the run, trained on the run's input -> output
mapping, so its compact model has exactly the size of every other method's (the
original inserts an extra layer).
"""

from __future__ import annotations

from ...registry import Registry
from ..losses import LossOptions
from ..teacher import MethodInputs
from .adapters import AdaLoraRun, AdapterRun, IsoLoraRun, LoraOptions, iso_rank, lora_params_per_rank, projection_names
from .base import Method, MethodRun
from .closed_form import (PLAIN_AUTO_WARM_MAX_STEPS, STREAMLINE_AUTO_WARM_MAX_STEPS, ClosedFormOptions,
                          ClosedFormRun, fits_warm_start, prepare as prepare_closed_form, resolve_warm_start, too_many_steps)
from .layerwise import LayerwiseRun
from .patch import PatchOptions, PatchRun
from .rankadaptor import RankAdaptorOptions, RankAdaptorRun
from .restorelcc import RestoreLCCOptions, RestoreLCCRun
from .whole_model import FullRun, KDOptions, OvercompleteRun

_LAYERWISE = dict(run=LayerwiseRun, objective="layerwise", default_lr=1e-3, family="layerwise", options=(LossOptions,),
                  needs_features=True, shardable=True)
_ADAPTER = dict(objective="lm", default_lr=1e-3, family="adapter", options=(LoraOptions,), planned_account=False)

#: Every recovery method: registering a Method here is the one edit that makes it known
#: (``recovery.method`` validation, ``overrep methods``, ``overrep compare``).
METHODS: Registry[Method] = Registry("recovery method")
for _m in [
    Method("overrep", "OverRep: overcomplete recovery blocks, layer-wise loss (recovery.loss), folded back exactly",
           **_LAYERWISE, width_lr=1e-4, auto_warm_start=True),
    Method("plain", "the same recovery blocks and layer-wise loss without W, D or annealing", **_LAYERWISE,
           preset="plain", auto_warm_start=True, auto_warm_max_steps=PLAIN_AUTO_WARM_MAX_STEPS),
    Method("streamline", "Streamline: one block (all weights) trained to replace the removed run", **_LAYERWISE,
           preset="plain-full", blocks=1, block_removal_only="it replaces a removed run of blocks",
           auto_warm_start=True, auto_warm_max_steps=STREAMLINE_AUTO_WARM_MAX_STEPS),
    Method("lora", "PEFT LoRA on all projections, language-model loss, merged", run=AdapterRun, **_ADAPTER),
    Method("adalora", "PEFT AdaLoRA, rank re-allocated every step, language-model loss, merged", run=AdaLoraRun,
           **_ADAPTER),
    Method("lora-iso", "LoRA with the rank that matches OverRep's trainable parameters", run=IsoLoraRun, **_ADAPTER,
           block_removal_only="its rank matches OverRep's recovery blocks on removed runs"),
    Method("rankadaptor", "RankAdaptor: LoRA with per-block ranks (mean lora_rank) chosen by a performance-model "
           "search over short probe fine-tunes, language-model loss, merged", run=RankAdaptorRun,
           **{**_ADAPTER, "options": (LoraOptions, RankAdaptorOptions)}),
    Method("full-ft", "full fine-tuning of every retained block, language-model loss", FullRun, "lm", 1e-4, "full",
           planned_account=False),
    Method("logit-kd", "every retained block trained on forward KL to the dense model's logits (tau=1)", FullRun,
           "kd", 1e-4, "full", options=(KDOptions,), planned_account=False),
    Method("overrep-kd", "OverRep's parameterisation trained with the logit-KD objective", OvercompleteRun, "kd",
           1e-3, "overcomplete", options=(KDOptions,)),
    Method("overrep-lm", "OverRep's parameterisation trained with the language-model loss (no teacher), folded back "
           "exactly", OvercompleteRun, "lm", 1e-3, "overcomplete"),
    Method("restorelcc", "RestoreLCC: lost-component vectors on the attention heads a probe found pruning hurt most, "
           "language-model loss, merged as an o_proj bias", RestoreLCCRun, "lm", 1e-3, "lost-components",
           options=(RestoreLCCOptions,),
           block_removal_only="it pairs each retained block with the same dense block"),
    Method("replaceme", "ReplaceMe: a linear map per removed run by least squares (robust to attention sinks: "
           "recovery.closed_tokens), folded into the down_proj before it; no training", ClosedFormRun, "lstsq", 0.0,
           "closed-form", options=(ClosedFormOptions,), trains=False, planned_account=False,
           block_removal_only="it replaces a removed run of blocks"),
    Method("prunecomp", "Prune&Comp alone: one scale per gap, mean|X_after|/mean|X_before| on calibration rows, "
           "folded exactly into the embeddings and the writes to the residual before it; no training", ClosedFormRun,
           "scale", 0.0, "closed-form", options=(ClosedFormOptions,), trains=False, planned_account=False,
           block_removal_only="it rescales the stream at a gap of removed blocks"),
    Method("replaceme-cos", "ReplaceMe's cosine variant: the same map by Adam on 1 - cos (recovery.closed_cos_*); "
           "no training of the model", ClosedFormRun, "cosine", 0.0, "closed-form", options=(ClosedFormOptions,),
           trains=False, planned_account=False, block_removal_only="it replaces a removed run of blocks"),
    # references, not exportable: the patch needs a d x d module the stock architecture lacks
    Method("linearpatch", "LinearPatch (a reference: needs an extra d x d module, so scored and never exported): "
           "a Hadamard rotation and per-channel scales at each gap, from calibration rows; no training", PatchRun,
           "patch", 0.0, "extra-module", options=(ClosedFormOptions,), trains=False, exports=False,
           planned_account=False, block1_init="retained", block_removal_only="it patches the stream at a gap"),
    Method("linearpatch-kd", "LinearPatch then its offline distillation (the patch alone, one pass, KL on the dense "
           "top-k: recovery.patch_kd_*); a reference, scored and never exported", PatchRun, "patch-kd", 0.0,
           "extra-module", options=(ClosedFormOptions, PatchOptions), trains=False, exports=False,
           planned_account=False, block1_init="retained", block_removal_only="it patches the stream at a gap"),
]:
    METHODS.register(_m)


def get_method(name: str) -> Method:
    return METHODS[name]


def build_recovery(inputs: MethodInputs, method: Method, *, with_data: bool = True,
                   prepared: dict | None = None) -> MethodRun:
    """``method`` set up on ``inputs`` (``with_data=False``: without the preparation that needs
    training data and is not cached, e.g. a layer-wise method's feature cache, for ``overrep
    plan`` and re-exporting from checkpoints). ``prepared``: what :func:`prepare_closed_form`
    already did to ``inputs.pruned`` (a time budget fits a warm start once, before its probe);
    None: do it here."""
    if prepared is None:
        prepared = prepare_closed_form(inputs, method)  # recovery.compensate, recovery.warm_start (in place)
    run = method.run(inputs, method, with_data=with_data)
    run.prepared = prepared
    return run


__all__ = ["METHODS", "Method", "MethodRun", "MethodInputs", "get_method", "build_recovery", "prepare_closed_form",
           "fits_warm_start", "resolve_warm_start", "too_many_steps", "iso_rank", "lora_params_per_rank", "projection_names"]
