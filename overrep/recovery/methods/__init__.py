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
restorelcc     2 x head_dim vectors on the attention heads a probe   language modelling
               found pruning hurt most (RestoreLCC), merged as o bias
replaceme      nothing: one linear map per removed run, fitted in       least squares (closed form)
               closed form, folded into the block before it's down_proj
replaceme-cos  nothing: the same map by Adam on the cosine distance     1 - cos (recovery.closed_cos_*)
=============  ===============================================  ======================

One module per family: :mod:`.layerwise` (overrep, plain, streamline), :mod:`.adapters`
(lora, adalora, lora-iso; rankadaptor's search in :mod:`.rankadaptor`), :mod:`.whole_model`
(full-ft, logit-kd, overrep-kd), :mod:`.restorelcc` (restorelcc; its probe in
:mod:`.restorelcc_probe`); what they share is in :mod:`.base`. A method receives a
:class:`~overrep.recovery.teacher.MethodInputs`
(models, plan, data, its config section, the teacher) and nothing else.

Streamline (Chen et al., 2024) replaces the pruned run with one trained layer; here that
layer is the retained block just before the run, trained on the run's input -> output
mapping, so its compact model has exactly the size of every other method's (the
original inserts an extra layer).
"""

from __future__ import annotations

from ...registry import Registry
from ..teacher import MethodInputs
from .adapters import AdapterRun, iso_rank, lora_params_per_rank, projection_names
from .base import Method, MethodRun
from .closed_form import ClosedFormRun, prepare as prepare_closed_form
from .layerwise import LayerwiseRun
from .rankadaptor import RankAdaptorRun, check_config as check_rankadaptor_config
from .restorelcc import RestoreLCCRun
from .whole_model import FullRun, OvercompleteKDRun

#: Every recovery method: registering a Method here is the one edit that makes it known
#: (``recovery.method`` validation, ``overrep methods``, ``overrep compare``).
METHODS: Registry[Method] = Registry("recovery method")
for _m in [
    Method("overrep", "OverRep: overcomplete recovery blocks, layer-wise loss (recovery.loss), folded back exactly",
           "layerwise", "mse", 1e-3),
    Method("plain", "the same recovery blocks and layer-wise loss without W, D or annealing", "layerwise", "mse",
           1e-3, preset="plain"),
    Method("streamline", "Streamline: one block (all weights) trained to replace the removed run",
           "layerwise", "mse", 1e-3, preset="plain-full", blocks=1),
    Method("lora", "PEFT LoRA on all projections, language-model loss, merged", "adapter", "lm", 1e-3),
    Method("adalora", "PEFT AdaLoRA, rank re-allocated every step, language-model loss, merged",
           "adapter", "lm", 1e-3),
    Method("lora-iso", "LoRA with the rank that matches OverRep's trainable parameters", "adapter", "lm", 1e-3),
    Method("rankadaptor", "RankAdaptor: LoRA with per-block ranks (mean lora_rank) chosen by a performance-model "
           "search over short probe fine-tunes, language-model loss, merged", "adapter", "lm", 1e-3),
    Method("full-ft", "full fine-tuning of every retained block, language-model loss", "full", "lm", 1e-4),
    Method("logit-kd", "every retained block trained on forward KL to the dense model's logits (tau=1)",
           "full", "kd", 1e-4),
    Method("overrep-kd", "OverRep's parameterisation trained with the logit-KD objective",
           "overcomplete-kd", "kd", 1e-3),
    Method("restorelcc", "RestoreLCC: lost-component vectors on the attention heads a probe found pruning hurt most, "
           "language-model loss, merged as an o_proj bias", "lost-components", "lm", 1e-3),
    Method("replaceme", "ReplaceMe: a linear map per removed run by least squares (robust to attention sinks: "
           "recovery.closed_tokens), folded into the down_proj before it; no training", "closed-form", "lstsq", 0.0),
    Method("replaceme-cos", "ReplaceMe's cosine variant: the same map by Adam on 1 - cos (recovery.closed_cos_*); "
           "no training of the model", "closed-form", "cosine", 0.0),
]:
    METHODS.register(_m)


def get_method(name: str) -> Method:
    return METHODS[name]




#: The class that sets up each family of methods ...
FAMILIES = {"layerwise": LayerwiseRun, "adapter": AdapterRun, "full": FullRun, "overcomplete-kd": OvercompleteKDRun,
            "lost-components": RestoreLCCRun, "closed-form": ClosedFormRun}
#: ... and the methods that extend their family's class (an adapter whose ranks a search chooses first).
RUN_CLASSES = {"rankadaptor": RankAdaptorRun}


def build_recovery(inputs: MethodInputs, method: Method, *, with_data: bool = True) -> MethodRun:
    """``method`` set up on ``inputs`` (``with_data=False``: without the preparation that needs
    training data and is not cached, e.g. a layer-wise method's feature cache, for ``overrep
    plan`` and re-exporting from checkpoints)."""
    cls = RUN_CLASSES.get(method.name) or FAMILIES[method.family]
    prepared = prepare_closed_form(inputs, method)  # recovery.compensate, recovery.warm_start
    run = cls(inputs, method, with_data=with_data)
    run.prepared = prepared
    return run


__all__ = ["METHODS", "FAMILIES", "Method", "MethodRun", "MethodInputs", "get_method", "build_recovery",
           "iso_rank", "lora_params_per_rank", "projection_names", "check_rankadaptor_config"]
