"""Composing a run config: where the configs live, and how a recipe's per-family mixer block reaches the model.

A recipe (`configs/experiment/<family>/<task>.yaml`) is one (paper, task) cell. Its backbone, data, optim and trainer
values apply to any model; its mixer arguments sit in `mixers.<name>` blocks, because they only make sense for one
family. After Hydra has composed the run, `apply_mixer_blocks` merges into `model.mixer`, in this order:

1. `mixers.<family>`  where `<family>` is the chosen model yaml's name up to its first `_` (`mega_chunk` -> `mega`);
2. `mixers.<model>`   the variant's own values for this cell (`mixers.mega_chunk.chunk_size: 2048` on enwik8);
3. the command line's `model.mixer.<key>=<value>` overrides, which always win.

Blocks for other families are dropped, so `experiment=las/listops model=transformer` builds a Transformer on LaS's
ListOps backbone without LaS's `pool_size`. Ablation files (`ablation=<family>/<name>`) write into the same blocks, after
the recipe, and must name the chosen model's family.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from longmixer.utils.errors import UserFacingError

# The config tree ships inside the package: a path for Hydra's compose API and globbing, a search path for
# `hydra.main` that works from an editable checkout and a regular install alike.
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
CONFIG_SEARCH_PATH = "pkg://longmixer.configs"
MIXER_BLOCKS = "mixers"


class RecipeError(UserFacingError, ValueError):
    """A recipe or ablation whose mixer blocks cannot apply to the chosen model; the message names the fix."""


def _group_defaults(config_dir: str) -> dict[str, str | None]:
    """train.yaml's defaults list: config group -> its default choice (None where the default is null)."""
    defaults = OmegaConf.to_container(OmegaConf.load(Path(config_dir) / "train.yaml")).get("defaults", [])
    return {key.removeprefix("optional ").strip(): value for entry in defaults if isinstance(entry, dict)
            for key, value in entry.items()}


def null_group_choices(argv: Sequence[str], config_dir: str = CONFIG_DIR) -> str | None:
    """The error for a command line that chooses null for a config group, else None.

    Hydra rejects `ablation=null` (or a sweep such as `ablation=null,las/vanilla`) at compose time with "Config group
    override must be a string or a list. Got NoneType", which names neither the argument nor the fix, and in a
    multirun only once the sweep has started. A deletion (`~ablation`, `~ablation=null`) is not a choice and passes.

    Args:
        argv: the command line after the program name (Hydra overrides and flags).
        config_dir: the config tree whose folders are the config groups.

    Returns:
        The message, naming the argument and the fix, or None.
    """
    root = Path(config_dir)
    groups = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.startswith("~"):
            continue
        key = key.lstrip("+").split("@")[0]
        if "." in key or key.split("/")[0] not in groups:
            continue
        choices = value.strip()
        for sweep in ("choice(", "range(", "glob(", "sort(", "shuffle("):
            if choices.startswith(sweep) and choices.endswith(")"):
                choices = choices[len(sweep):-1]
        values = [c.strip() for c in choices.split(",")]
        if not any(v.lower() == "null" for v in values):
            continue
        rest = ",".join(v for v in values if v and v.lower() != "null")
        default = _group_defaults(config_dir).get(key)  # read only for the error: not on every start
        drop = (f"write ~{key} to run without one (leaving it out keeps {key}={default})" if default is not None
                else f"leave {key} out to run without one")
        fix = (f"{drop}; in a sweep, run that job as its own command and sweep {key}={rest} in another" if rest
               else drop)
        return f"{arg}: a config group ({key}) cannot be chosen as null on the command line (Hydra rejects it); {fix}"
    return None


TASK_MODES = ("max", "min")


def task_mode_choice(argv: Sequence[str]) -> str | None:
    """The error for a command-line `task.mode` other than max or min (each value of a sweep), else None.

    The task's constructor refuses such a value in one line, but an Optuna search (`hparams_search=optuna`) derives
    its study's direction from `task.mode` while Hydra builds the sweeper, before any job starts, and Hydra reports
    the resolver's error there as a traceback."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.lstrip("+") != "task.mode":
            continue
        for sweep in ("choice(", "glob("):
            if value.startswith(sweep) and value.endswith(")"):
                value = value[len(sweep):-1]
        bad = [v.strip() for v in value.split(",") if v.strip().strip("'\"") not in TASK_MODES]
        if bad:
            return (f"{arg}: task.mode is the monitored metric's direction, one of {', '.join(TASK_MODES)} (max for "
                    f"accuracy, min for a loss), not {', '.join(bad)}")
    return None


def refuse_before_hydra(argv: Sequence[str]) -> None:
    """Exit with status 2 before Hydra starts where the command line chooses null for a config group
    (`null_group_choices`), an impossible `task.mode` (`task_mode_choice`), a print flag without `--cfg`
    (`print_flag_alone`) or `--cfg` beside `-m` (`cfg_beside_mode`); the train and evaluate entry points.
    Logging is not configured yet, so the message goes to stderr as is. A command line that only asks for the config
    (`--cfg job|all`, `--help`) is answered here, with the mixer blocks applied (`show_config`), and exits 0."""
    if problem := (null_group_choices(argv) or task_mode_choice(argv) or print_flag_alone(argv)
                   or cfg_beside_mode(argv)):
        sys.stderr.write(f"error: {problem}\n")
        raise SystemExit(2)
    if show_config(argv):
        raise SystemExit(0)


# Hydra's flags that take a value (`--cfg job`), those after which another Hydra command runs (not a config
# print) and those that choose other configs than the packaged ones, which `show_config` does not compose.
_VALUE_FLAGS = {"--cfg": "cfg", "-c": "cfg", "--package": "package", "-p": "package", "--config-path": "config",
                "-cp": "config", "--config-name": "config", "-cn": "config", "--config-dir": "config",
                "-cd": "config", "--info": "other", "-i": "other", "--shell-completion": "other", "-sc": "other",
                "--experimental-rerun": "other"}
_OTHER_FLAGS = ("--hydra-help", "--version", "-m", "--multirun", "-r", "--run")


def _hydra_flags(argv: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    """The Hydra flags of a command line by kind (`cfg`, `package`, `config`, `other`, `help`, `resolve`: the value
    or the flag itself) and its overrides."""
    flags: dict[str, str | None] = {}
    overrides, args = [], list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.partition("=")
        if name in _VALUE_FLAGS:
            flags.setdefault(_VALUE_FLAGS[name], arg if _VALUE_FLAGS[name] == "config" else
                             (value if eq else args.pop(0) if args and not args[0].startswith("-") else None))
        elif arg in _OTHER_FLAGS:
            flags["other"] = arg
        elif arg in ("-h", "--help"):
            flags["help"] = arg
        elif arg == "--resolve":
            flags["resolve"] = arg
        elif not arg.startswith("-"):
            overrides.append(arg)
    return flags, overrides


def print_flag_alone(argv: Sequence[str]) -> str | None:
    """Why a command line's `-p` / `--package` or `--resolve` cannot be what it asks, or None: they shape the print
    of `--cfg job|all` (and `--resolve` that of `--help`). Without one, Hydra ignores `-p` and starts the run the
    user meant to inspect, and stops `--resolve` with a traceback."""
    flags, _ = _hydra_flags(argv)
    alone = [flag for flag, kind in (("-p/--package", "package"), ("--resolve", "resolve")) if kind in flags]
    if not alone or "cfg" in flags or ("help" in flags and alone == ["--resolve"]):
        return None
    key = flags.get("package")
    shape = f" -p {key}" if key else ""
    return (f"{' and '.join(alone)} shape the config that --cfg prints and do nothing alone: add --cfg job (or --cfg "
            f"all) to print it, e.g. `--cfg job{shape}{' --resolve' if 'resolve' in flags else ''}`, or leave "
            f"{'them' if len(alone) > 1 else 'it'} out to run")


# Hydra's flags that, like `--cfg`, choose what the command does: Hydra takes one of them and stops the rest with a
# ValueError traceback ("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified").
_MODE_FLAGS = ("-m", "--multirun", "-r", "--run", "-i", "--info", "-sc", "--shell-completion")


def cfg_beside_mode(argv: Sequence[str]) -> str | None:
    """Why a command line's `--cfg` cannot be answered, or None: beside `-m` (`train -m seed=0,1 --cfg job`, to see a
    sweep's config), `--run`, `--info` or `--shell-completion`, Hydra stopped with a traceback and exit status 1."""
    flags, _ = _hydra_flags(argv)
    mode = next((arg.partition("=")[0] for arg in argv if arg.partition("=")[0] in _MODE_FLAGS), None)
    if "cfg" not in flags or mode is None:
        return None
    sweep = " and give each swept key one value" if mode in ("-m", "--multirun") else ""
    return (f"--cfg prints one run's config and Hydra takes it alone, not beside {mode}: leave {mode} out{sweep} to "
            "print it, or leave --cfg out to run")


def _config_request(argv: Sequence[str]) -> dict | None:
    """What a command line asks to print: `{"what": "job" | "all" | "help", "package", "resolve", "overrides",
    "config": the flag choosing other configs or None}`, or None where it asks for something else (a run, a sweep,
    `--cfg hydra`, Hydra's own help or info)."""
    flags, overrides = _hydra_flags(argv)
    # Hydra answers --help before anything else; --cfg hydra and the other commands are Hydra's own
    what = "help" if "help" in flags else flags.get("cfg") if "other" not in flags else None
    if what not in ("job", "all", "help"):
        return None
    return {"what": what, "package": flags.get("package"), "resolve": "resolve" in flags, "overrides": overrides,
            "config": flags.get("config")}


def show_config(argv: Sequence[str], job_name: str | None = None) -> bool:
    """Print what `--cfg job`, `--cfg all` (`-c`, with `--package` and `--resolve`) or `--help` asks for, as the run
    would use it: Hydra prints its composed config, before `apply_mixer_blocks` has merged the recipe's and the
    ablation's `mixers.<name>` blocks into `model.mixer`, so `experiment=chela/text ablation=chela/ema --cfg job`
    showed `conv: short_long` for a run that uses `ema`. The output is otherwise Hydra's (its help template, its
    `# @package` line).

    Args:
        argv: the command line after the program name.
        job_name: Hydra's job name (its help's first line, `hydra.job.name`); None: the entry point's module
            (`train` for `python -m longmixer.train` and `longmixer-train`).

    Returns:
        True where it printed the answer (the caller exits 0), False where the command line asks for something else.
        A command line that does not compose returns False too: Hydra then refuses it with its own message.

    Raises:
        SystemExit(2): with `--config-dir`, `--config-path` or `--config-name`, which choose configs this print does
            not compose (Hydra's print would not apply the mixer blocks either); with `--package` of a key the
            config does not have; for mixer blocks that cannot apply (`RecipeError`, which the run stops on).
    """
    request = _config_request(argv)
    if request is None:
        return False
    if request["config"]:
        sys.stderr.write(f"error: {request['config']}: --cfg and --help print the packaged configs "
                         f"({CONFIG_DIR}) with the recipe's mixer blocks applied, and cannot follow another config "
                         "dir or name; leave the flag out, or add the config to that tree\n")
        raise SystemExit(2)
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    name = job_name or Path(sys.argv[0]).stem.removeprefix("longmixer-")
    try:
        with _composing(request["overrides"], None, name) as cfg:
            HydraConfig.instance().set_config(cfg)  # `--resolve` reads ${hydra:...}
            text = _config_text(cfg, request)
    except RecipeError as err:  # the run would stop on it too: say so rather than print a config that never runs
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    except (HydraException, OmegaConfBaseException):
        return False
    sys.stdout.write(text)
    return True


def _config_text(cfg: DictConfig, request: dict) -> str:
    """The text Hydra's `--cfg` or `--help` prints for `cfg` (a composed config with its `hydra` node)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra

    what, package, resolve = request["what"], request["package"], request["resolve"]
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    if what == "help":  # Hydra's own help builder (its template, groups and flags), given the merged config
        hydra = GlobalHydra.instance().hydra
        return hydra.get_help(cfg.hydra.help, job, get_args_parser(), resolve=resolve) + "\n"
    shown = job if what == "job" else cfg
    if package not in (None, "_global_"):
        shown = OmegaConf.select(shown, package)
        if shown is None:
            sys.stderr.write(f"error: --package {package}: no such key in the config\n")
            raise SystemExit(2)
    if not isinstance(shown, (DictConfig, ListConfig)):
        return f"{shown}\n"
    if resolve:
        OmegaConf.resolve(shown)
    return (f"# @package {package}\n" if package not in (None, "_global_") else "") + OmegaConf.to_yaml(shown)


def family_of(model: str) -> str:
    """The family of a model yaml name: `mega_chunk` -> `mega`, `chela` -> `chela`."""
    return model.split("_", 1)[0]


def model_names(config_dir: str = CONFIG_DIR) -> set[str]:
    return {p.stem for p in (Path(config_dir) / "model").glob("*.yaml")}


def _cli_mixer_overrides(overrides: Sequence[str]) -> list[tuple[str, object]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([o for o in overrides if o.lstrip("+~").startswith("model.")])
    return [(o.key_or_group, o.value()) for o in parsed
            if o.key_or_group.startswith("model.mixer.") and not o.is_delete()]


def apply_mixer_blocks(cfg: DictConfig, choices: Mapping[str, str | None], overrides: Sequence[str] = ()) -> DictConfig:
    """Merge the blocks of `cfg.mixers` that belong to the chosen model into `cfg.model.mixer` and drop `cfg.mixers`.

    Args:
        cfg: the composed run config (changed in place and returned).
        choices: Hydra's group choices (`model`, `ablation`, ...), as in `HydraConfig.get().runtime.choices`.
        overrides: the command-line overrides; `model.mixer.*` ones are applied again so they win over the blocks.

    Raises:
        RecipeError: a block named after no model yaml, or an ablation of another family than the model's.
    """
    if MIXER_BLOCKS not in cfg:
        return cfg
    with open_dict(cfg):
        blocks = cfg.pop(MIXER_BLOCKS)
    model = choices.get("model")
    if blocks is None or model is None:
        return cfg
    known = model_names()
    for name in blocks:
        if name not in known:
            raise RecipeError(f"mixers.{name}: no configs/model/{name}.yaml; a mixer block is named after a family "
                              f"or a model variant, one of {sorted(known)}")
    family = family_of(model)
    ablation = choices.get("ablation")
    if ablation not in (None, "null") and family_of(str(ablation).split("/")[0]) != family:
        raise RecipeError(f"ablation={ablation} belongs to another family than model={model}; pick an ablation "
                          f"under configs/ablation/{family}/")
    for name in dict.fromkeys((family, model)):
        block = blocks.get(name)
        if block is None:
            continue
        with open_dict(cfg.model.mixer):
            cfg.model.mixer.merge_with(block)  # interpolations stay unresolved
    with open_dict(cfg):
        for key, value in _cli_mixer_overrides(overrides):
            OmegaConf.update(cfg, key, value, merge=True)
    return cfg


def command_line_overrides(argv: Sequence[str]) -> list[str]:
    """The Hydra overrides of an entry point's command line (its flags, `-m`, `--cfg job`, ... left out)."""
    return [a for a in argv if not a.startswith("-") and "=" in a]


def run_explaining_refusals(hydra_main: Callable[[], Any], argv: Sequence[str]) -> None:
    """Run an entry point's `hydra.main` function; when it ends with exit status 1 (Hydra refused the command line,
    or the run failed) outside a sweep, print `override_hint`'s lines, which are None for the latter."""
    try:
        hydra_main()
    except SystemExit as exit_:
        if exit_.code == 1 and "-m" not in argv and "--multirun" not in argv:
            hint = override_hint(command_line_overrides(argv))
            for line in hint.splitlines() if hint else ():
                print(f"error: {line}", file=sys.stderr)
        raise


def override_hint(overrides: Sequence[str], config_dir: str = CONFIG_DIR) -> str | None:
    """Why Hydra refused `overrides`: one line with a "did you mean" per refused override (several lines where
    several are wrong; Hydra names only the first), or None where they compose (the run failed for another
    reason). Hydra's own messages say that a key is "not in struct" without naming the keys there are, and list a
    nested group's options only at its top level (`experiment=chela/listopz` shows `quickstart`)."""
    import re

    from hydra.errors import ConfigCompositionException, MissingConfigException

    rest = [o for o in overrides if not o.startswith("hydra")]
    refused: list[tuple[str, str]] = []  # ("group", "experiment/chela/listopz") or ("key", "trainer.max_step")
    cfg = None
    for _ in range(len(rest) + 1):
        try:
            cfg = compose(rest, config_dir=config_dir)
            break
        except MissingConfigException as err:
            missing = re.search(r"Could not find '([^']+)'", str(err))
            if missing is None:
                break
            refused.append(("group", missing.group(1)))
            name = missing.group(1).split("/", 1)[0]
        except ConfigCompositionException as err:
            found = re.search(r"Could not override '([^']+)'", str(err))
            if found is None or "not in struct" not in str(err.__cause__):
                break
            refused.append(("key", found.group(1)))
            name = found.group(1)
        kept = [o for o in rest if o.lstrip("+~").split("=", 1)[0] != name]
        if len(kept) == len(rest):
            break
        rest = kept
    hints = [_group_hint(what, config_dir) if kind == "group" else _key_hint(what, cfg)
             for kind, what in refused]
    return "\n".join(h for h in hints if h) or None


def _group_hint(wanted: str, config_dir: str) -> str:
    """The line for a group option that is not there (`experiment/chela/listopz`): the close name and the options."""
    import difflib

    folder = Path(config_dir) / Path(wanted).parent
    group = wanted.split("/", 1)[0]
    names = sorted(str(p.relative_to(Path(config_dir) / group).with_suffix(""))
                   for p in (Path(config_dir) / group).rglob("*.yaml"))
    close = difflib.get_close_matches(wanted.split("/", 1)[1], names, n=1)
    if folder.is_dir():
        where, known = f"configs/{Path(wanted).parent}/", sorted(p.stem for p in folder.glob("*.yaml"))
    else:
        where, known = f"configs/{group}/", names
    return (f"{group}={wanted.split('/', 1)[1]} is not a config of configs/{group}/"
            + (f" (did you mean {group}={close[0]}?)" if close else "") + f"; in {where}: {', '.join(known)}")


def _key_hint(key: str, cfg: DictConfig | None) -> str | None:
    """The line for a key that is not there (`trainer.max_step`), from the config the other overrides compose to
    (None where they do not: Hydra's message stands)."""
    import difflib

    if cfg is None:
        return None
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = sorted(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(leaf, keys, n=1)
    return (f"{key} is not a key of {parent or 'the config'}"
            + (f" (did you mean {(parent + '.') if parent else ''}{close[0]}?)" if close else "")
            + f"; its keys: {', '.join(keys)}. A key that is not there yet is added with +{key}=...")


def compose(overrides: Sequence[str] = (), *, config_dir: str = CONFIG_DIR, hydra_config: bool = False) -> DictConfig:
    """Compose `train.yaml` with `overrides` as `python -m longmixer.train` would, mixer blocks applied.

    Args:
        overrides: Hydra overrides (`experiment=mega/listops`, `model=mega_chunk`, `data.seq_len=64`).
        config_dir: the config directory (tests point it at a copy).
        hydra_config: keep the `hydra` node (needed to register a HydraConfig for an in-process `train()`).
    """
    with _composing(overrides, config_dir) as cfg:
        if not hydra_config:
            with open_dict(cfg):
                del cfg["hydra"]
    return cfg


@contextmanager
def _composing(overrides: Sequence[str], config_dir: str | None, job_name: str | None = None) -> Iterator[DictConfig]:
    """`compose`'s config with its `hydra` node, inside Hydra's compose context (where `GlobalHydra` lists the
    config groups for `--help`). `config_dir=None`: the packaged configs as the entry points' `hydra.main` finds
    them (`CONFIG_SEARCH_PATH`, which `hydra.runtime.config_sources` records)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from longmixer.utils.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    job_name = job_name or "app"  # Hydra's compose API's name
    initialize = (initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name=job_name) if config_dir
                  else initialize_config_module(CONFIG_SEARCH_PATH.removeprefix("pkg://"), version_base="1.3",
                                                job_name=job_name))
    with initialize:
        cfg = hydra_compose("train", overrides=list(overrides), return_hydra_config=True)
        apply_mixer_blocks(cfg, dict(cfg.hydra.runtime.choices), overrides)
        yield cfg
