"""Every config composes; every recipe instantiates its model and datamodule on CPU; bad configs fail at compose
time with a message naming the key."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from longmixer.utils.config import ConfigError, validate_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _group(name):
    return sorted(str(p.relative_to(CONFIGS / name).with_suffix("")) for p in (CONFIGS / name).rglob("*.yaml"))


RECIPES = _group("experiment")
MODELS = _group("model")
DATA = _group("data")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(compose, recipe):
    cfg = compose([f"experiment={recipe}"])
    validate_config(cfg)
    OmegaConf.to_container(cfg.model, resolve=True)


@pytest.mark.parametrize("model", MODELS)
def test_model_family_instantiates(compose, model):
    cfg = compose([f"model={model}", "~experiment", "data=listops_gen"])
    validate_config(cfg)
    net = instantiate(cfg.model)
    assert sum(p.numel() for p in net.parameters()) > 0


@pytest.mark.parametrize("data", DATA)
def test_data_config_instantiates(compose, data):
    cfg = compose([f"data={data}", "~experiment"])
    validate_config(cfg)
    instantiate(cfg.data)  # the constructor alone: no download, no files needed


def test_typo_in_override_names_the_key(compose):
    with pytest.raises(ConfigCompositionException, match="chunk_sise"):
        compose(["model.mixer.chunk_sise=3"])


def test_missing_group_option_lists_choices(compose):
    with pytest.raises(ConfigCompositionException, match="transformer"):
        compose(["model=transfomer"])


def test_unknown_constructor_key_is_rejected(compose):
    cfg = compose(["+model.mixer.n_head=2"])
    with pytest.raises(ConfigError, match=r"model.mixer.n_head .*did you mean 'n_heads'"):
        validate_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("seed=-1", "seed=-1 must be an integer >= 0"),
    ("resume=sometimes", "resume='sometimes' is not one of"),
    ("optim.optimizer=sgdd", "optim.optimizer='sgdd'"),
    ("optim.lr=0", "optim.lr=0"),
    ("ops.backend=cuda", "ops.backend='cuda'"),
])
def test_impossible_values_fail_with_the_key(compose, override, message):
    cfg = compose([override])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_config(cfg)


def test_seed_zero_is_valid(compose):
    validate_config(compose(["seed=0"]))


def test_slurm_launcher_config_composes(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from longmixer.utils.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.partition == "gpu" and cfg.hydra.launcher.gpus_per_node == 1
