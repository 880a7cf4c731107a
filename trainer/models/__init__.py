"""Qwen3-Next-compatible hybrid decoder: config, model over packed rows, the HF state-dict adapter, loading."""
from trainer.models.config import NAMED_CONFIGS, ModelConfig, debugmodel, debugmodel_dense, debugmodel_deep, smallmodel
from trainer.models.loading import build_model, load_model, model_config, read_config
from trainer.models.materialize import materialize, meta_model
from trainer.models.qwen3_next import ModelOutput, Qwen3NextForRL, RunOptions
from trainer.models.state_dict_adapter import StateDictAdapter

__all__ = [
    "NAMED_CONFIGS", "ModelConfig", "debugmodel", "debugmodel_dense", "debugmodel_deep", "smallmodel",
    "build_model", "load_model", "model_config", "read_config", "materialize", "meta_model", "ModelOutput",
    "Qwen3NextForRL", "RunOptions", "StateDictAdapter",
]
