"""Every config composes; every family's model instantiates on every recipe; recipes are one per (paper, task) cell
and a variant keeps its identity on its family's recipes; bad configs fail at compose time naming the key."""

from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from longmixer.utils.compose import CONFIG_DIR, RecipeError, family_of
from longmixer.utils.config import ConfigError, check_task_and_data, validate_config

CONFIGS = Path(CONFIG_DIR)


def _group(name):
    return sorted(str(p.relative_to(CONFIGS / name).with_suffix("")) for p in (CONFIGS / name).rglob("*.yaml"))


RECIPES = _group("experiment")
MODELS = _group("model")
DATA = _group("data")
FAMILIES = sorted({family_of(m) for m in MODELS})
CELLS = [r for r in RECIPES if "/" in r]  # <family>/<task>; quickstart is the embedded default, not a paper cell


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(compose, recipe):
    cfg = compose([f"experiment={recipe}"])
    validate_config(cfg)
    check_task_and_data(cfg)
    OmegaConf.to_container(cfg.model, resolve=True)


@pytest.mark.parametrize("overrides, message", [
    (["data=synthetic_bytes", "~experiment", "model=chela"],
     r"data \(SyntheticBytes\) is language-modelling data .*, and the task is Classification: it needs "
     r"task=language_model and the model's LM keys \(model.num_classes=null .*experiment=<family>/enwik8"),
    (["data=enwik8", "~experiment", "model=mega", "task=language_model"],
     r"data \(Enwik8\) is language-modelling data .*model.num_classes reads it: a model on it needs the LM keys"),
    (["experiment=chela/listops", "task=language_model"],
     r"task=language_model needs language-modelling data .*data \(\w+\) is classification data with "
     r"data.num_classes=10: use task=classification"),
])
def test_a_task_its_data_cannot_serve_is_refused_with_the_recipe_to_use(compose, overrides, message):
    """Any model on any task, but a classification task or model on language-modelling data (or the LM task on
    classification data) failed inside the run on an interpolation, with a traceback; it stops on one line."""
    cfg = compose(overrides)
    validate_config(cfg)
    with pytest.raises(ConfigError, match=message):
        check_task_and_data(cfg)


def test_an_lm_recipe_takes_another_lm_dataset_and_model(compose):
    check_task_and_data(compose(["experiment=mega/enwik8", "model=mega_chunk", "data=synthetic_bytes"]))
    check_task_and_data(compose(["experiment=chela/wikitext103", "model=longvq", "data=enwik8"]))


TASKS = sorted({r.split("/")[1] for r in CELLS})
# One recipe per task for the quick tier: MEGA's where it has one (the recipe most papers compare against).
TASK_RECIPE = {t: next((r for r in CELLS if r == f"mega/{t}"), next(r for r in CELLS if r.endswith(f"/{t}")))
               for t in TASKS}


def _heads_that_fit(cfg) -> list[str]:
    """A head count dividing the recipe's width, for a family whose default does not (LaS's 8 heads on SC10's 60)."""
    heads, width = cfg.model.mixer.get("n_heads"), cfg.model.d_model
    if not heads or width % heads == 0:
        return []
    with pytest.raises(Exception, match=f"d_model={width} must be divisible by model.mixer.n_heads={heads}"):
        with torch.device("meta"):
            instantiate(cfg.model)
    return [f"model.mixer.n_heads={max(h for h in range(1, heads + 1) if width % h == 0)}"]


def _family_on_recipe(compose, recipe, family):
    """Any model on any recipe: the recipe's backbone, data and optim apply, its mixer block only to its own family
    (`experiment=las/listops model=transformer` once failed on LaS's `pool_size`, `mega/image` on `zdim`). Built on
    the meta device: shapes and constructor checks run, no memory is allocated."""
    overrides = [f"experiment={recipe}", f"model={family}"]
    cfg = compose(overrides)
    if heads := _heads_that_fit(cfg):
        cfg = compose([*overrides, *heads])
    validate_config(cfg)
    assert cfg.model.mixer._target_ == OmegaConf.load(CONFIGS / "model" / f"{family}.yaml").mixer._target_
    instantiate(cfg.data)
    with torch.device("meta"):
        net = instantiate(cfg.model)
    assert sum(p.numel() for p in net.parameters()) > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", TASKS)
def test_every_family_instantiates_on_every_task(compose, task, family):
    _family_on_recipe(compose, TASK_RECIPE[task], family)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", [r for r in CELLS if r not in TASK_RECIPE.values()])
def test_every_family_instantiates_on_every_recipe(compose, recipe, family):
    """The other recipes of each task (the quick tier's test above runs one a task)."""
    _family_on_recipe(compose, recipe, family)


def _recipe_without_model(recipe: str) -> dict:
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "experiment" / f"{recipe}.yaml"))
    node["defaults"] = [d for d in node.get("defaults", []) if not (isinstance(d, dict) and "override /model" in d)]
    node.pop("mixers", None)
    return node


def test_no_two_recipes_differ_only_in_their_model():
    """A variant is a model swap on its family's recipe (`experiment=mega/listops model=mega_chunk`), never a copy."""
    seen: dict[str, str] = {}
    for recipe in RECIPES:
        key = repr(_recipe_without_model(recipe))
        assert key not in seen, f"configs/experiment/{recipe}.yaml equals {seen[key]}.yaml except for its model"
        seen[key] = recipe


VARIANT_CELLS = [(r, m) for r in CELLS for m in MODELS if "_" in m and family_of(m) == r.split("/")[0]]


@pytest.mark.parametrize("recipe, variant", VARIANT_CELLS)
def test_variant_keeps_its_own_mixer_values(compose, recipe, variant):
    """A variant's defining keys (seqboat_full's `window: null`, mega_chunk's `chunk_size`) survive the family's
    recipe block unless the recipe's `mixers.<variant>` block sets the cell's own value."""
    own = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{variant}.yaml").mixer, resolve=False)
    blocks = OmegaConf.to_container(OmegaConf.load(CONFIGS / "experiment" / f"{recipe}.yaml")).get("mixers") or {}
    cfg = compose([f"experiment={recipe}", f"model={variant}"])
    mixer = OmegaConf.to_container(cfg.model.mixer, resolve=False)
    for key, value in own.items():
        assert mixer[key] == (blocks.get(variant) or {}).get(key, value), f"{variant}.{key} on {recipe}"


def test_transformer_scifar_is_the_lra_image_recipe(compose):
    """No source gives sCIFAR's Transformer settings, so its recipe says it is LRA Image's unchanged on the colour
    input: the model, optimizer, schedule and trainer compose to the same values."""
    image, scifar = compose(["experiment=transformer/image"]), compose(["experiment=transformer/scifar"])
    for key in ("model", "optim", "scheduler", "trainer"):
        assert OmegaConf.to_container(scifar[key]) == OmegaConf.to_container(image[key]), key


def test_seqboat_full_on_pathx_has_no_working_memory(compose):
    """SeqBoat-full on Path-X once ran as SeqBoat: the recipe's `window: 512` overrode seqboat_full's `window: null`."""
    assert compose(["experiment=seqboat/pathx", "model=seqboat_full"]).model.mixer.window is None
    assert compose(["experiment=seqboat/pathx"]).model.mixer.window == 512


def test_variant_cell_values_and_command_line_order(compose):
    assert compose(["experiment=mega/enwik8", "model=mega_chunk"]).model.mixer.chunk_size == 2048
    assert compose(["experiment=mega/enwik8"]).model.mixer.chunk_size is None
    cfg = compose(["experiment=mega/enwik8", "model=mega_chunk", "model.mixer.chunk_size=64"])
    assert cfg.model.mixer.chunk_size == 64  # the command line wins over the recipe's blocks


def test_ablation_of_another_family_is_rejected(compose):
    with pytest.raises(RecipeError, match="ablation=seqboat/mem32 belongs to another family"):
        compose(["experiment=mega/listops", "ablation=seqboat/mem32"])


def test_mixer_block_must_name_a_model(compose):
    with pytest.raises(RecipeError, match="mixers.mgea: no configs/model/mgea.yaml"):
        compose(["+mixers.mgea.chunk_size=3"])


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


@pytest.mark.parametrize("arg, fix", [
    ("ablation=null", "leave ablation out to run without one"),
    ("ablation=null,las/vanilla", "sweep ablation=las/vanilla in another"),
    ("+ablation=choice(null, las/l)", "sweep ablation=las/l in another"),
    ("ablation=NULL", "leave ablation out"),
    ("logger=null", "write ~logger to run without one (leaving it out keeps logger=csv)"),
])
def test_null_for_a_config_group_is_refused_before_hydra_with_the_fix(compose, arg, fix):
    """Hydra's own error for a group set to null names neither the argument nor the fix (and a multirun meets it
    only once its sweep has started); the train and evaluate entry points check the command line first."""
    from longmixer.utils.compose import null_group_choices

    with pytest.raises(ValueError, match="Config group override must be a string"):
        compose([arg.lstrip("+").split("=")[0] + "=null"])
    problem = null_group_choices(["-m", "experiment=las/smnist", arg, "seed=0,1"])
    assert problem is not None and problem.startswith(arg) and fix in problem


@pytest.mark.parametrize("argv", [["ablation=las/vanilla", "model.mixer.window=null", "ckpt_path=null"],
                                  ["~ablation", "~ablation=null", "debug=limit", "hydra.sweep.dir=null"],
                                  ["hydra/launcher=submitit_slurm", "+experiment=las/smnist", "paths.data_dir=/null",
                                   "tags=[a,null]", "--config-name=train", "-m"]])
def test_null_values_of_keys_deletions_and_other_group_choices_pass_the_check(argv):
    """Only a config group chosen as null is refused: null values of keys, deletions (Hydra accepts `~ablation`
    and `~ablation=null`) and paths that merely contain "null" pass."""
    from longmixer.utils.compose import null_group_choices

    assert null_group_choices(argv) is None


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_entry_points_refuse_a_null_group_choice_with_exit_2(entry, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"longmixer.{entry}")
    monkeypatch.setattr("sys.argv", [f"{entry}.py", "-m", "experiment=las/smnist", "ablation=null,las/vanilla"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    assert "error: ablation=null,las/vanilla: a config group (ablation)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, bad", [(["hparams_search=optuna", "task.mode=best"], "best"),
                                       (["-m", "task.mode=max,maximum"], "maximum"),
                                       (["+task.mode=choice(min, 'loss')"], "'loss'")])
def test_an_impossible_task_mode_is_refused_before_hydra(argv, bad):
    """An Optuna search resolves its direction from task.mode while Hydra builds the sweeper, where a refusal is a
    traceback: the command line is checked first, every value of a sweep."""
    from longmixer.utils.compose import task_mode_choice

    problem = task_mode_choice(argv)
    assert problem is not None and problem.startswith(argv[-1]) and problem.endswith(f"not {bad}")
    assert task_mode_choice(["task.mode=min", "-m", "task.mode=max,min", "task.monitor=val/loss"]) is None


def test_train_refuses_a_task_mode_under_optuna_in_one_line(monkeypatch, capsys):
    from longmixer import train

    monkeypatch.setattr("sys.argv", ["train.py", "hparams_search=optuna", "experiment=quickstart", "task.mode=best"])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: task.mode=best: task.mode is the monitored metric's direction") and "Trace" not in err


def _shown(argv, capsys, job_name="train") -> str:
    from longmixer.utils.compose import show_config

    assert show_config(argv, job_name=job_name)
    return capsys.readouterr().out


def test_cfg_job_and_all_print_the_config_with_the_mixer_blocks_applied(capsys):
    """Hydra's `--cfg` printed its composed config, before the recipe's and the ablation's `mixers.<name>` blocks
    reach `model.mixer`: `experiment=chela/text ablation=chela/ema --cfg job` showed `conv: short_long` for a run
    that uses `ema` (and a `mixers:` node the run does not have)."""
    import yaml

    argv = ["experiment=chela/text", "ablation=chela/ema"]
    job = yaml.safe_load(_shown([*argv, "--cfg", "job"], capsys))
    assert job["model"]["mixer"]["conv"] == "ema" and "mixers" not in job and "hydra" not in job
    everything = yaml.safe_load(_shown(["-c", "all", *argv], capsys))
    assert everything["model"]["mixer"]["conv"] == "ema" and everything["hydra"]["job"]["name"] == "train"
    assert everything["hydra"]["runtime"]["config_sources"][1] == {"path": "longmixer.configs", "schema": "pkg",
                                                                   "provider": "main"}
    package = _shown([*argv, "--cfg=job", "--package", "model.mixer"], capsys)
    assert package.startswith("# @package model.mixer\n") and yaml.safe_load(package)["conv"] == "ema"
    resolved = yaml.safe_load(_shown([*argv, "--cfg", "job", "--resolve", "-p", "model"], capsys))
    assert resolved["mixer"]["max_len"] == 4096 and resolved["mixer"]["conv"] == "ema"
    assert _shown([*argv, "--cfg", "job", "-p", "seed"], capsys) == "0\n"


def test_help_shows_the_config_the_run_uses(capsys):
    text = _shown(["experiment=chela/text", "ablation=chela/ema", "--help"], capsys, job_name="evaluate")
    assert text.startswith("evaluate is powered by Hydra.") and "== Configuration groups ==" in text
    assert "ablation/chela: ema, longconv, s4d" in text and "conv: ema" in text and "short_long" not in text
    assert "mixers:" not in text


@pytest.mark.parametrize("argv", [["seed=1"], ["--cfg", "hydra"], ["-m", "--cfg", "job"], ["--info", "defaults"],
                                  ["--hydra-help"], ["model=nope", "--cfg", "job"]])
def test_other_commands_are_left_to_hydra(argv):
    """A run, Hydra's own prints and a command line that does not compose (Hydra refuses it in its words) go on to
    Hydra."""
    from longmixer.utils.compose import show_config

    assert not show_config(argv)


@pytest.mark.parametrize("argv, message", [
    (["--cfg", "job", "-cd", "/tmp"], "error: -cd: --cfg and --help print the packaged configs"),
    (["--cfg", "job", "-p", "model.nope"], "error: --package model.nope: no such key in the config"),
    (["--cfg", "job", "experiment=las/listops", "ablation=chela/ema"], "error: ablation=chela/ema belongs to another"),
])
def test_a_config_print_that_cannot_be_faithful_is_refused(argv, message, capsys):
    from longmixer.utils.compose import show_config

    with pytest.raises(SystemExit) as exit_info:
        show_config(argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(message)


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_entry_points_print_the_config_before_hydra_and_exit_0(entry, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"longmixer.{entry}")
    monkeypatch.setattr("sys.argv", [f"/x/longmixer/{entry}.py", "experiment=chela/text", "ablation=chela/ema",
                                     "--cfg", "job", "-p", "model.mixer.conv"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 0 and capsys.readouterr().out == "ema\n"


@pytest.mark.parametrize("entry", ["train", "evaluate"])
@pytest.mark.parametrize("flags, shown", [(["-p", "model.mixer"], "-p/--package"), (["--resolve"], "--resolve"),
                                          (["--package=model", "--resolve"], "-p/--package and --resolve")])
def test_a_print_flag_without_cfg_is_refused_before_anything_runs(entry, flags, shown, monkeypatch, capsys):
    """`-p` and `--resolve` only shape `--cfg`'s print: alone, Hydra ignored `-p` and started the run the user meant
    to inspect, and stopped `--resolve` with a traceback. The entry point stops first, naming the flag to add."""
    import importlib

    module = importlib.import_module(f"longmixer.{entry}")
    monkeypatch.setattr("sys.argv", [f"{entry}.py", "experiment=mega/listops", *flags])
    monkeypatch.setattr(module, "_main", lambda: pytest.fail("the run started"), raising=False)
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: {shown} shape the config that --cfg prints"), err
    assert "--cfg job" in err


@pytest.mark.parametrize("entry", ["train", "evaluate"])
@pytest.mark.parametrize("flags, mode", [(["-m", "--cfg", "job"], "-m"), (["--cfg=all", "--multirun"], "--multirun"),
                                         (["--cfg", "job", "--info"], "--info")])
def test_cfg_beside_multirun_is_refused_in_one_line(entry, flags, mode, monkeypatch, capsys):
    """Hydra takes one of `--cfg`, `-m`, `--run`, `--info`: `train -m seed=0,1 --cfg job` (what a user types to see
    a sweep's config) ended in Hydra's `ValueError` traceback with exit status 1. The entry point stops first, in one
    line with exit status 2, naming the flag to leave out."""
    import importlib

    module = importlib.import_module(f"longmixer.{entry}")
    monkeypatch.setattr("sys.argv", [f"{entry}.py", "experiment=mega/listops", "seed=0,1", *flags])
    monkeypatch.setattr(module, "_main", lambda: pytest.fail("the run started"), raising=False)
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: --cfg "), err
    assert f"leave {mode} out" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["--cfg", "job", "-p", "model"], ["--cfg", "all", "--resolve"],
                                  ["--help", "--resolve"], ["seed=1"], ["--cfg", "hydra", "-p", "hydra.run"]])
def test_print_flags_with_what_they_shape_pass(argv):
    from longmixer.utils.compose import print_flag_alone

    assert print_flag_alone(argv) is None


def test_missing_group_option_lists_choices(compose):
    with pytest.raises(ConfigCompositionException, match="transformer"):
        compose(["model=transfomer"])


def test_unknown_constructor_key_is_rejected(compose):
    cfg = compose(["+model.mixer.n_head=2"])
    with pytest.raises(ConfigError, match=r"model.mixer.n_head .*did you mean 'n_heads'"):
        validate_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("+ops.backnd=torch", r"unknown key ops.backnd \(did you mean 'backend'\?\); allowed: \['backend'\]"),
    ("+paths.data_dri=/scratch/data", r"unknown key paths.data_dri \(did you mean 'data_dir'\?\)"),
])
def test_a_key_added_under_ops_or_paths_is_refused(compose, override, message):
    """`ops` and `paths` have no `_target_` whose signature would refuse a typo, and Hydra's "not in struct" error
    (with our hint) tells the user to add the key with `+`: `+ops.backnd=torch` then trained on the default backend
    and `+paths.data_dri=...` read the default data folder, with exit status 0."""
    cfg = compose([override])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("+callbacks.chekpoint.monitor=val/acc", r"callbacks.chekpoint is not one of this run's callbacks .*\(did you "
                                             r"mean 'checkpoint'\?\)"),
    ("+callbacks.early_stopping.patience=5", r"callbacks.early_stopping .*; callbacks=early_stopping adds it"),
    ("+logger.wandb.project=mine", r"logger.wandb is not one of this run's loggers .*; logger=wandb adds it; the "
                                   r"run's loggers: csv"),
])
def test_a_key_on_a_callback_or_logger_the_run_lacks_is_refused_with_the_option(compose, override, message):
    """A `+` key on a callback or logger entry the run does not have made an entry without a `_target_`, which
    compose-time validation let through: instantiating the group then raised a bare ValueError ("callbacks.chekpoint
    has no _target_"), a traceback and exit status 1, with neither the close name nor the group option that adds it."""
    cfg = compose([override])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize("strategy", ["pytorch_lightning.strategies.DDPStrategy",
                                      "longmixer.utils.strategies.ZeroDDPStrategy"])
def test_ddp_strategy_takes_the_arguments_it_passes_to_distributed_data_parallel(compose, strategy):
    """Lightning's DDP strategy hands its **kwargs to torch's DistributedDataParallel: those names are its keys, and
    its typos are still caught, with the close name."""
    cfg = compose(["trainer=ddp", f"trainer.strategy={{_target_:{strategy},gradient_as_bucket_view:true,"
                                  "bucket_cap_mb:100,static_graph:false}"])
    validate_config(cfg)
    cfg = compose(["trainer=ddp", f"trainer.strategy={{_target_:{strategy},gradient_as_bucket_vew:true}}"])
    with pytest.raises(ConfigError, match=r"trainer.strategy.gradient_as_bucket_vew .*'gradient_as_bucket_view'"):
        validate_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("seed=-1", "seed=-1 must be an integer >= 0"),
    ("resume=sometimes", "resume='sometimes' is not one of"),
    ("optim.lr=0", "optim.lr=0"),
    ("+optim.betaz=[0.9,0.9]", "unknown key optim.betaz"),
    ("+scheduler.warmup=3", "unknown key scheduler.warmup .*did you mean 'warmup_steps'"),
    ("ops.backend=cuda", "ops.backend='cuda'"),
    ("optim.lr=abc", "optim.lr='abc' must be a number"),
    ("trainer.max_steps=abc", "trainer.max_steps='abc' must be a whole number"),
    ("trainer.max_steps=2.5", "trainer.max_steps=2.5 must be a whole number"),
    ("data.batch_size=64.0", "data.batch_size=64.0 must be a whole number"),
    ("data.batch_size=true", "data.batch_size=True must be a whole number"),
    ("trainer.gradient_clip_val=high", "trainer.gradient_clip_val='high' must be a number"),
])
def test_impossible_values_fail_with_the_key(compose, override, message):
    cfg = compose([override])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("model.d_model=abc", r"^model.d_model='abc' must be a whole number \(SequenceModel takes d_model: int\)$"),
    ("model.dropout=abc", r"^model.dropout='abc' must be a number \(SequenceModel takes dropout: float\)$"),
    ("model.n_layers=2.5", r"^model.n_layers=2.5 must be a whole number"),
    ("model.d_model=64.0", r"^model.d_model=64.0 must be a whole number"),
    ("model.prenorm=yes", r"^model.prenorm='yes' must be true or false \(SequenceModel takes prenorm: bool\)$"),
    ("model.mixer.hidden_dropout=none", r"^model.mixer.hidden_dropout='none' must be a number \(CHELA takes"),
    ("model.d_ffn=-3", r"^model.d_ffn=-3: a size of the model must be >= 1 or null \(SequenceModel takes d_ffn: "
                       r"int \| None\)$"),
    ("model.d_model=0", r"^model.d_model=0: a size of the model must be >= 1 \(SequenceModel"),
    ("model.mixer.n_heads=0", r"^model.mixer.n_heads=0: a size of the model must be >= 1 \(CHELA takes n_heads"),
    ("model=mega model.mixer.zdim=-3", r"^model.mixer.zdim=-3: a size of the model must be >= 1 \(MEGA"),
    ("model=seqboat model.mixer.window=0", r"^model.mixer.window=0: a size of the model must be >= 1 or null"),
    ("scheduler.warmup_steps=abc", r"^scheduler.warmup_steps='abc' must be a whole number \(LinearDecay takes"),
    ("scheduler.warmup_steps=-1", r"^scheduler \(LinearDecay\): scheduler.warmup_steps=-1 must be >= 0$"),
    ("scheduler=plateau ~scheduler.warmup_steps scheduler.factor=2", r"^scheduler \(Plateau\): scheduler.factor=2 must be in \(0, 1\)$"),
    ("scheduler=inverse_sqrt scheduler.warmup_steps=0", r"^scheduler \(InverseSqrtDecay\): .*must be >= 1"),
    ("trainer.val_check_interval=0", r"^trainer.val_check_interval=0 must be > 0"),
    ("trainer.val_check_interval=-0.5", r"^trainer.val_check_interval=-0.5 must be > 0"),
    ("trainer.enable_progress_bar=3", r"^trainer.enable_progress_bar=3 must be true or false or null \(Trainer"),
])
def test_a_value_its_constructor_cannot_take_fails_with_the_key(compose, override, message):
    """Values that reached the constructors (or, for the scheduler, Lightning's fit) and failed there with a
    traceback naming no key: `'<' not supported between str and int`, `float cannot be interpreted as an integer`,
    `Trying to create tensor with negative dimension -3`, a ZeroDivisionError inside Lightning. The check reads each
    `_target_`'s annotations, so it covers every family's keys."""
    cfg = compose(override.split())
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("optim.weight_decay=-1", r"^optim \(AdamW\): Invalid weight_decay value: -1; change optim.weight_decay=-1$"),
    ("optim.eps=-1", r"^optim \(AdamW\): Invalid epsilon value: -1; change optim.eps=-1$"),
    ("optim=adam optim.betas=[0.9,1.5]", r"^optim \(Adam\): Invalid beta parameter at index 1: 1.5; change optim.betas"),
    ("optim=sgd_nesterov optim.momentum=-1", r"^optim \(SGD\): Invalid momentum value: -1; change optim.momentum=-1$"),
])
def test_a_value_the_optimizer_refuses_fails_at_compose_time_with_the_key(compose, override, message):
    """Bug: the optimizer is built inside Lightning's fit, so a value its constructor refuses
    (`optim.weight_decay=-1`) passed the config checks and ended the run with a traceback naming no key."""
    with pytest.raises(ConfigError, match=message):
        validate_config(compose(override.split()))


@pytest.mark.parametrize("override, message", [
    ("trainer.accumulate_grad_batches=0", r"^trainer.accumulate_grad_batches=0 must be >= 1 \(the batches of one"),
    ("trainer.accumulate_grad_batches=-2", r"^trainer.accumulate_grad_batches=-2 must be >= 1"),
    ("trainer.check_val_every_n_epoch=0", r"^trainer.check_val_every_n_epoch=0 must be >= 1 \(.*or null"),
    ("trainer.log_every_n_steps=0", r"^trainer.log_every_n_steps=0 must be >= 1 \(log the training loss .*every N "
                                    r"optimizer steps, e.g. 50; Lightning logs none at 0 and reads -N as N\)$"),
    ("trainer.log_every_n_steps=-1", r"^trainer.log_every_n_steps=-1 must be >= 1 \("),
])
def test_a_trainer_count_below_one_fails_with_the_key(compose, override, message):
    """Bug: `trainer.accumulate_grad_batches=0` and `trainer.check_val_every_n_epoch=0` passed the config checks and
    ended the run with a ZeroDivisionError inside Lightning's fit; a negative accumulation trained silently. So did
    `trainer.log_every_n_steps=0` (no per-step loss or learning-rate curve) and `-N` (read as N; -1: every step)."""
    with pytest.raises(ConfigError, match=message):
        validate_config(compose(override.split()))


def test_a_negative_gradient_clip_fails_with_the_key(compose):
    """Bug: `trainer.gradient_clip_val=-1` passed every check and trained with every gradient's sign flipped (the
    clipping coefficient max_norm / norm is negative), so the optimizer climbed the loss without a word."""
    with pytest.raises(ConfigError, match=r"^trainer.gradient_clip_val=-1 must be >= 0: .*0 or null: no clipping$"):
        validate_config(compose(["trainer.gradient_clip_val=-1"]))
    validate_config(compose(["trainer.gradient_clip_val=0"]))


@pytest.mark.parametrize("override, key", [
    ("callbacks=early_stopping callbacks.early_stopping.patience=-1", "callbacks.early_stopping.patience=-1"),
    ("+callbacks.stop={_target_:pytorch_lightning.callbacks.EarlyStopping,monitor:val/loss,patience:-3}",
     "callbacks.stop.patience=-3"),
])
def test_a_negative_early_stopping_patience_fails_with_the_key(compose, override, key):
    """Bug: `callbacks.early_stopping.patience=-1` passed every check, and Lightning's EarlyStopping took it without
    a word and stopped training at the first validation without improvement (as at 0 or 1). Any EarlyStopping
    callback, under whatever name, now stops at compose time with its key; 0 is Lightning's value."""
    with pytest.raises(ConfigError, match=rf"^{key} must be >= 0: the validations without an improvement of "
                                          r"val/\w+ after which training stops, e.g. 10 \(below 0, Lightning stops "
                                          r"at the first\)$"):
        validate_config(compose(override.split()))
    validate_config(compose(["callbacks=early_stopping", "callbacks.early_stopping.patience=0"]))


@pytest.mark.parametrize("override", ["model.d_ffn=null", "model=seqboat model.mixer.window=null", "model.dropout=0",
                                      "trainer.val_check_interval=0.5", "trainer.gradient_clip_val=1",
                                      "trainer.enable_progress_bar=false", "scheduler.warmup_steps=0",
                                      "trainer.check_val_every_n_epoch=null", "trainer.accumulate_grad_batches=1",
                                      "trainer.log_every_n_steps=1", "trainer.log_every_n_steps=null"])
def test_values_the_constructors_take_pass_the_type_checks(compose, override):
    validate_config(compose(override.split()))


@pytest.mark.parametrize("override, message", [
    ("data.batch_size=0", r"^data \(GeneratedListOps\): data.batch_size=0 must be >= 1 \(raised at base.py:\d+\)$"),
    ("model.mixer.n_heads=3", r"^model \(SequenceModel\): model.mixer.n_heads=3 must divide model.d_model=64 "
                              r"\(raised at chela.py:\d+\)$"),
    ("model.dropout=2", r"^model \(SequenceModel\): dropout probability has to be between 0 and 1, but got 2"),
    ("trainer.max_epochs=-5", r"^trainer \(Trainer\): `max_epochs` must be a non-negative integer or -1"),
])
def test_a_constructor_s_refusal_names_the_key_in_one_line(compose, override, message):
    """Values the composed-config checks pass but a constructor refuses reach the user as a ConfigError naming the
    config key, the class and where it was raised (printed as one line, exit 2), not as Hydra's multi-line
    instantiation error."""
    from longmixer.train import train

    cfg = compose([override])
    with pytest.raises(ConfigError, match=message) as info:
        train(cfg)
    assert "\n" not in str(info.value)


def test_a_monitor_the_task_never_logs_is_refused_before_training(compose, tmp_path):
    """`task.monitor=val/acc_bst` passed every check and trained until the first validation, where Lightning's
    checkpoint callback could not find it (a MisconfigurationException traceback, exit 1), which on a recipe's
    schedule comes hours into the run. The task refuses it when it is built, with the metrics it logs."""
    from longmixer.train import train
    from tests.conftest import TINY_LISTOPS, TINY_TRAINER

    with pytest.raises(ConfigError, match=r"^task \(Classification\): task.monitor='val/acc_bst' is not a metric "
                                          r"this task logs: one of val/acc, val/loss, or a model's val/aux/"):
        train(compose(["task.monitor=val/acc_bst", *TINY_LISTOPS, *TINY_TRAINER]))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before the first step
    results = train(compose(["task.monitor=val/loss", "task.mode=min", "run_tag=loss", *TINY_LISTOPS, *TINY_TRAINER]))
    assert "val/loss_best" in results["metrics"]


def test_a_negative_longvq_commit_coef_fails_before_training(compose):
    """Bug: LongVQ's `model.mixer.commit_coef=-1` (gamma of the commitment loss, eq. 23) passed every check and
    trained with a commitment term that pushed the keys away from their codewords. The quantizer refuses it when
    `train()` builds the model (`instantiate_node`), before training, naming the key; 0 (no commitment loss) is a
    value."""
    from longmixer.runs.run import instantiate_node

    cfg = compose(["model=longvq", "model.mixer.commit_coef=-1"])
    validate_config(cfg)  # a float of the right type: the quantizer's own check refuses it
    with pytest.raises(ConfigError, match=r"^model \(SequenceModel\): model.mixer.commit_coef=-1 must be >= 0 \(0: no "
                                          r"commitment loss\); LongVQ uses 1e-4 \(raised at vq.py:\d+\)$"):
        instantiate_node(cfg.model)
    model = instantiate_node(compose(["model=longvq", "model.mixer.commit_coef=0"]).model)
    assert model.blocks[0].mixer.vq.commit_coef == 0


def _raise_user_facing(**_):
    from longmixer.utils.errors import UserFacingError

    raise UserFacingError("prepare the data first: python scripts/prepare_data.py text")


@pytest.mark.parametrize("node, kind", [
    ({"_target_": "os.listdir", "path": "/no/such/dir"}, "FileNotFoundError"),  # no setting's refusal
    ({"_target_": "json.dumps", "obj": 1, "not_a_kw": 2}, "JSONEncoder.__init__()"),  # a TypeError deeper down
    ({"_target_": "json.JSONEncoder", "bogus": 1}, "ConfigError"),  # an argument of the target's own signature
    ({"_target_": "tests.test_configs._raise_user_facing"}, "UserFacingError"),  # ours: raised as it is
    ({"_target_": "torch.nn.Linear", "in_features": 4, "out_features": -3}, "ConfigError"),  # a negative width
])
def test_which_constructor_errors_become_config_errors(node, kind):
    from omegaconf import OmegaConf

    from longmixer.runs.run import instantiate_node
    from longmixer.utils.errors import UserFacingError

    with pytest.raises(Exception) as info:
        instantiate_node(OmegaConf.create(node))
    if kind == "ConfigError" and node["_target_"] == "torch.nn.Linear":
        assert type(info.value) is ConfigError
        assert str(info.value).startswith("config (Linear): Trying to create tensor with negative dimension -3: "
                                          "[-3, 4]; config.out_features=-3: a size must be >= 1 (raised at ")
    elif kind == "ConfigError":
        assert type(info.value) is ConfigError
        assert str(info.value).startswith("config (JSONEncoder): JSONEncoder.__init__() got an unexpected keyword "
                                          "argument 'bogus'")
    elif kind == "UserFacingError":
        assert type(info.value) is UserFacingError and "prepare the data first" in str(info.value)
    else:
        assert not isinstance(info.value, ConfigError) and kind in str(info.value)


class _UnpackingBug:
    """A constructor with a bug: the interpreter's ValueError, not a check of an argument."""

    def __init__(self, width: int = 4):
        rows, cols = torch.empty(width).shape


class _InitBug:
    """A constructor with a bug: torch's initializer refuses the tensor it was wrongly given."""

    def __init__(self, width: int = 4):
        self.weight = torch.nn.init.xavier_uniform_(torch.empty(width))


class _Checked:
    """A constructor outside longmixer that checks its argument."""

    def __init__(self, width: int = 4):
        if width < 1:
            raise ValueError(f"width={width} must be >= 1")


def _schedule_with_a_bug(optimizer, total_steps, warmup_steps=0, warmup_init_lr=0.0, warmup_power=1.0, end_lr=0.0):
    (steps,) = divmod(total_steps, 2)


@pytest.mark.parametrize("target, message", [
    ("tests.test_configs._UnpackingBug", "not enough values to unpack"),
    ("tests.test_configs._InitBug", "Fan in and fan out can not be computed"),
], ids=["interpreter", "library-function"])
def test_a_value_error_of_a_bug_in_a_constructor_keeps_its_traceback(target, message):
    """A ValueError raised by a bug inside a constructor was reported as a refused setting (one line, exit 2, the
    traceback only at DEBUG). It keeps Hydra's error, which names the `_target_`, and its traceback (exit 1)."""
    from hydra.errors import InstantiationException

    from longmixer.runs.run import instantiate_node

    with pytest.raises(InstantiationException) as info:
        instantiate_node(OmegaConf.create({"_target_": target}))
    assert f"Error in call to target '{target}'" in str(info.value) and message in str(info.value)
    assert isinstance(info.value.__cause__, ValueError) and info.value.__cause__.__traceback__ is not None


@pytest.mark.parametrize("node, message", [
    ({"_target_": "tests.test_configs._Checked", "width": 0}, "config (_Checked): width=0 must be >= 1 (raised at "
                                                              "test_configs.py:"),
    ({"_target_": "torch.nn.Dropout", "p": 2}, "config (Dropout): dropout probability has to be between 0 and 1, "
                                               "but got 2 (raised at dropout.py:"),
    ({"_target_": "longmixer.layers.norms.build_norm", "kind": "groupnorm", "d_model": 4},
     "config (build_norm): norm='groupnorm' is not one of"),
], ids=["own-constructor", "library-constructor", "longmixer-helper"])
def test_a_value_error_of_an_argument_check_stays_a_refused_setting(node, message):
    from longmixer.runs.run import instantiate_node

    with pytest.raises(ConfigError) as info:
        instantiate_node(OmegaConf.create(node))
    assert str(info.value).startswith(message)


def test_a_value_error_of_a_bug_in_the_schedule_keeps_its_traceback(compose):
    """The schedule built at the config check: a bug's ValueError was reported as a refused scheduler setting."""
    cfg = compose(["scheduler._target_=tests.test_configs._schedule_with_a_bug"])
    with pytest.raises(ValueError, match="too many values to unpack") as info:
        validate_config(cfg)
    assert not isinstance(info.value, ConfigError)


def test_a_bug_in_a_constructor_reaches_the_entry_point_with_its_target(compose):
    from hydra.errors import InstantiationException

    from longmixer.train import train

    cfg = compose(["+callbacks.bug._target_=tests.test_configs._InitBug"])
    with pytest.raises(InstantiationException, match="Error in call to target 'tests.test_configs._InitBug'"):
        train(cfg)


def test_seed_zero_is_valid(compose):
    validate_config(compose(["seed=0"]))


def test_slurm_launcher_config_composes(tmp_path):
    from longmixer.utils.compose import compose

    cfg = compose(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.partition == "gpu" and cfg.hydra.launcher.gpus_per_node == 1
    assert cfg.hydra.launcher.tasks_per_node == 1


def test_readme_slurm_command_runs_a_task_per_device():
    """Under SLURM Lightning stops unless --ntasks-per-node equals trainer.devices: the README's multi-GPU SLURM
    command sets tasks_per_node, gpus_per_node and trainer.devices alike, and composes."""
    import re
    from pathlib import Path

    from longmixer.utils.compose import compose

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    command = re.search(r"python -m longmixer\.train -m hydra/launcher=slurm(.*?)\n```", readme, re.S).group(1)
    args = command.replace("\\\n", " ").split()
    values = dict(a.split("=", 1) for a in args if "=" in a)
    assert values["hydra.launcher.tasks_per_node"] == values["hydra.launcher.gpus_per_node"] == values["trainer.devices"]
    cfg = compose(["hydra/launcher=slurm", *[a for a in args if "seed=" not in a], "seed=0", "paths.data_dir=/null"],
                  hydra_config=True)
    assert cfg.hydra.launcher.tasks_per_node == cfg.trainer.devices == 4


def test_run_name_tells_a_variant_from_its_family(compose):
    assert compose(["experiment=mega/listops"]).run_name == "mega/listops"
    assert compose(["experiment=mega/listops", "model=mega_chunk"]).run_name == "mega/listops-mega_chunk"
    assert compose(["~experiment", "model=mega", "data=listops_gen"]).run_name == "mega-listops_gen"


@pytest.mark.parametrize("task, patience", [("listops", 5), ("text", 10), ("retrieval", 20), ("image", 10),
                                            ("pathfinder", 10)])
def test_las_lra_recipes_train_as_s4_v1_configs(compose, task, patience):
    """LaS's Table 4 rows follow S4's v1 LRA configs (lra/old/s4-lra-*.yaml): ReduceLROnPlateau with their patience,
    no warmup, float32 even on `trainer=gpu` (the paper's V100s)."""
    cfg = compose([f"experiment=las/{task}", "trainer=gpu"])
    assert cfg.scheduler._target_ == "longmixer.utils.optim.Plateau"
    assert cfg.scheduler.patience == patience and cfg.scheduler.factor == 0.2 and cfg.scheduler.mode == "max"
    assert "warmup_steps" not in cfg.scheduler
    assert cfg.trainer.precision == "32-true" and cfg.trainer.gradient_clip_val is None


def test_las_wikitext103_recipe_has_the_papers_shape(compose):
    """LaS appendix C: 12 layers, width 768, context 512, causal; appendix A: 8 heads in all experiments."""
    cfg = compose(["experiment=las/wikitext103"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.data.seq_len) == (12, 768, 512)
    assert cfg.model.mixer.n_heads == 8 and cfg.model.causal is True


def test_las_listops_recipe_leaves_the_token_embedding_undecayed(compose):
    """S4's parameter grouping, which LaS ran with: `nn.Embedding` gets no weight decay (recipe wd 0.01)."""
    from longmixer.utils.optim import build_param_groups

    cfg = compose(["experiment=las/listops", "data.vocab_size=20", "data.num_classes=10", "model.n_layers=1"])
    model = instantiate(cfg.model)
    (wd,) = [g["weight_decay"] for g in build_param_groups(model, lr=1e-3, weight_decay=cfg.optim.weight_decay)
             if any(p is model.embedding.weight for p in g["params"])]
    assert cfg.optim.weight_decay == 0.01 and wd == 0.0


@pytest.mark.parametrize("family", ["chela", "longvq"])
def test_settings_taken_from_mega_are_megas(compose, family):
    """Where CHELA and LongVQ are silent their recipes take MEGA's: Path-X warms up with power 2 over 25k steps, and
    the classifier drops out at the model's dropout rate."""
    mega, ours = compose(["experiment=mega/pathx"]), compose([f"experiment={family}/pathx"])
    assert (ours.scheduler.warmup_steps, ours.scheduler.warmup_power) == (mega.scheduler.warmup_steps, 2.0)
    text = compose([f"experiment={family}/text"])
    assert text.model.dropout > 0 and text.model.classifier_dropout == text.model.dropout


# CHELA Table 7: depth, d_model, d_FFN, Attn-FN, Norm, Pre-norm, BSZ, LR, Dropout, WD, Epochs; and the training-set
# size the epochs are counted over (SC10: 70 % per class of the 34,975 full-length clips, within a few of 24,482;
# docs/data.md).
CHELA_TABLE_7 = {
    "listops": (6, 80, 160, "laplace", "batchnorm", False, 64, 1e-3, 0.1, 0.01, 60, 96_000),
    "text": (4, 128, 256, "norm", "scalenorm", False, 50, 4e-3, 0.1, 0.01, 50, 25_000),
    "retrieval": (6, 128, 256, "norm", "scalenorm", False, 64, 3e-3, 0.1, 0.04, 40, 147_086),
    "image": (8, 160, 320, "laplace", "batchnorm", True, 50, 1e-2, 0.0, 0.02, 200, 45_000),
    "scifar": (8, 160, 320, "laplace", "batchnorm", True, 50, 1e-2, 0.0, 0.02, 200, 45_000),  # appendix A.1
    "pathfinder": (6, 128, 256, "laplace", "batchnorm", True, 128, 1e-2, 0.0, 0.01, 200, 160_000),
    "pathx": (4, 64, 128, "laplace", "batchnorm", True, 128, 1e-2, 0.0, 0.01, 100, 160_000),
    "sc10": (6, 60, 120, "laplace", "batchnorm", True, 20, 1e-2, 0.0, 0.01, 200, 24_482),
}


@pytest.mark.parametrize("task", sorted(CHELA_TABLE_7))
def test_chela_recipes_are_table_7_rows(compose, task):
    """Every value of CHELA's Table 7 row, and its epochs as steps (epochs x batches an epoch): SC10 ran MEGA's 250k
    steps, 204 epochs of our split, against the table's 200."""
    depth, width, ffn, attn, norm, prenorm, bsz, lr, dropout, wd, epochs, n_train = CHELA_TABLE_7[task]
    cfg = compose([f"experiment=chela/{task}"])
    m = cfg.model
    assert (m.n_layers, m.d_model, m.d_ffn, m.mixer.attention, m.norm, m.prenorm) == (depth, width, ffn, attn, norm,
                                                                                       prenorm)
    assert cfg.data.batch_size * cfg.trainer.accumulate_grad_batches == bsz
    assert (cfg.optim.lr, m.dropout, m.mixer.dropout, cfg.optim.weight_decay) == (lr, dropout, dropout, wd)
    assert cfg.trainer.max_steps == epochs * -(-n_train // bsz)


@pytest.mark.parametrize("task", ["listops", "text", "retrieval", "image", "pathfinder", "pathx", "scifar", "sc10",
                                  "wikitext103", "enwik8"])
def test_longvq_recipes_take_section_5_settings(compose, task):
    """LongVQ section 5: codebook 512, AdamW, clip 0.1, gamma 1e-4, EMA 0.99, bf16 compute, softmax, post-norm, and a
    global batch of 128 sequences on the classification recipes; the LM recipes keep MEGA's one row per device (the
    paper gives no sequence length for LM: docs/reproduction.md)."""
    cfg = compose([f"experiment=longvq/{task}"])
    mixer = cfg.model.mixer
    assert (mixer.n_codes, mixer.commit_coef, mixer.codebook_decay, mixer.attention) == (512, 1e-4, 0.99, "softmax")
    assert cfg.optim._target_ == "torch.optim.AdamW" and cfg.trainer.gradient_clip_val == 0.1
    assert cfg.trainer.precision == "bf16-mixed" and cfg.model.prenorm is False
    rows = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches
    assert rows == (1 if task in ("wikitext103", "enwik8") else 128)


@pytest.mark.parametrize("task, width", [("listops", 160), ("text", 256), ("retrieval", 256), ("image", 320),
                                         ("pathfinder", 256), ("pathx", 256)])
def test_seqboat_lra_recipes_carry_the_official_architecture_defaults(compose, task, width):
    """The official slag_lra_* architectures: classifier width 2D; embedding and classifier dropout = --dropout on
    the text tasks; MEGA's real-valued embedding init on the pixel tasks; EMA truncation 1024 on Text / Retrieval;
    Path-X warms up with power 2."""
    cfg = compose([f"experiment=seqboat/{task}"])
    assert cfg.model.d_classifier == width == 2 * cfg.model.d_model
    if task in ("listops", "text", "retrieval"):
        assert cfg.model.embed_dropout == cfg.model.classifier_dropout == cfg.model.mixer.dropout == 0.1
    else:
        assert (cfg.model.embed_std, cfg.model.embed_bias_std) == (1.0, 0.1)
        assert cfg.model.pos_encoding == "scaled_sinusoidal"
    if task in ("text", "retrieval"):
        assert cfg.model.mixer.truncation == 1024
    assert cfg.scheduler.warmup_power == (2.0 if task == "pathx" else 1.0)


def test_seqboat_enwik8_drops_out_at_table_5s_rate_embedding_included(compose):
    """SeqBoat Table 5: "Dropout 0.15", "Attention Dropout 0.0"; the official --dropout 0.15 drops out the token
    embedding too (SeqBoatDecoderNoCrossAttn.embedding_dropout), as the LRA recipes' embedding dropout follows theirs."""
    cfg = compose(["experiment=seqboat/enwik8"])
    assert cfg.model.embed_dropout == cfg.model.mixer.dropout == 0.15
    assert cfg.model.mixer.hidden_dropout == 0.0


@pytest.mark.parametrize("override, hint", [
    ("trainer.max_step=2", "trainer.max_step is not a key of trainer (did you mean trainer.max_steps?)"),
    ("modle=chela", "modle is not a key of the config (did you mean model?)"),
    ("model=chelaa", "model=chelaa is not a config of configs/model/ (did you mean model=chela?)"),
    ("experiment=chela/listopz", "experiment=chela/listopz is not a config of configs/experiment/ (did you mean "
                                 "experiment=chela/listops?); in configs/experiment/chela/: enwik8"),
])
def test_a_command_line_hydra_refuses_gets_a_did_you_mean(override, hint):
    """Hydra's own messages for these ("not in struct", a nested group listed as its top level only) name no close
    key; the entry points print this line after them."""
    from longmixer.utils.compose import override_hint

    assert hint in override_hint(["experiment=quickstart", override])
    assert override_hint(["experiment=quickstart", "trainer.max_steps=2"]) is None  # composes: the run failed later


def test_every_refused_override_gets_its_line():
    """Hydra names the first refused override only; each gets its line, the keys listed from what the others
    compose to."""
    from longmixer.utils.compose import override_hint

    lines = override_hint(["experiment=chela/listopz", "trainer.max_step=2", "optim.lrr=1", "seed=3"]).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("experiment=chela/listopz is not a config of configs/experiment/ (did you mean "
                               "experiment=chela/listops?)")
    assert lines[1].startswith("trainer.max_step is not a key of trainer (did you mean trainer.max_steps?)")
    assert lines[2].startswith("optim.lrr is not a key of optim (did you mean optim.lr?); its keys: ")


def test_the_entry_point_prints_a_line_per_refused_override(monkeypatch, capsys):
    from longmixer import train

    monkeypatch.setattr("sys.argv", ["train.py", "trainer.max_step=2", "optim.lrr=1"])
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 1 and len(errors) == 2, errors
    assert "did you mean trainer.max_steps?" in errors[0] and "did you mean optim.lr?" in errors[1]


def test_callbacks_none_keeps_the_runs_checkpointing(compose):
    """`callbacks=none` drops the optional callbacks only: without the run's checkpoint callback Lightning's default
    one would be tested instead of the best validation checkpoint, and nothing could be resumed or evaluated."""
    callbacks = {k for k, v in compose(["callbacks=none"]).callbacks.items() if v is not None}
    assert callbacks == {"resume_step", "checkpoint"}


@pytest.mark.parametrize("task", ["image", "pathfinder"])
def test_token_pixels_as_the_docs_give_them_train_the_embedding_of_pixel_zero(compose, task):
    """docs/data.md's token-pixel overrides: pixel value 0 gets a trainable embedding (by default row 0 is the
    padding row, frozen at zero)."""
    cfg = compose([f"experiment=chela/{task}", "data.vocab_size=256", "data.d_input=null", "+model.padding_idx=null",
                   "model.n_layers=1", "model.d_model=16"])
    validate_config(cfg)
    model = instantiate(cfg.model)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    model.embedding(tokens).sum().backward()
    (weight,) = [p for p in model.embedding.parameters() if p.dim() == 2]
    assert weight[0].abs().sum() > 0 and weight.grad[0].abs().sum() > 0


def test_radam_decays_weights_decoupled_as_the_fairseq_radam_of_seqboat(compose):
    """`optim=radam` (SeqBoat's enwik8 recipe) multiplies weights by 1 - lr * wd as MEGA's fairseq RAdam does;
    torch's default L2 form decayed a weight with small gradients several times faster."""
    cfg = compose(["experiment=seqboat/enwik8"])
    weight = torch.nn.Parameter(torch.ones(64))
    optimizer = instantiate(cfg.optim)([weight])
    lr, wd = cfg.optim.lr, cfg.optim.weight_decay
    for _ in range(20):
        weight.grad = torch.zeros_like(weight)
        optimizer.step()
    assert weight.detach() == pytest.approx(torch.full((64,), (1 - lr * wd) ** 20), rel=1e-6)
