"""A 2-step fit (train, validate, test at the best checkpoint) of every model family on generated ListOps and of
the Transformer on every task's fixture in the real on-disk format."""

from pathlib import Path

import pytest

from longmixer.train import train
from tests.conftest import TINY_LISTOPS, TINY_TRAINER
from tests.data import fixtures, fixtures_extra

MODELS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "model").glob("*.yaml"))
REAL_VALUED: list[str] = []  # the model's embedding=auto follows data.vocab_size / data.d_input
LM = ["task=language_model", "model.causal=true", "model.pool=none", "model.head=lm_tied", "model.num_classes=null"]


def _data_overrides(values: dict) -> list[str]:
    return [f"data.{k}={v}" for k, v in values.items()]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_fits_two_steps_on_listops(compose, model):
    cfg = compose([f"model={model}", "model.n_layers=1", *TINY_LISTOPS, *TINY_TRAINER])
    metrics = train(cfg)["metrics"]
    assert 0.0 <= metrics["test/acc"] <= 1.0


def write_listops_fixture(root: Path) -> dict:
    from tests.data.test_listops import _write_official

    _write_official(Path(root) / "listops-1000")
    return {"source_dir": str(Path(root) / "listops-1000"), "seq_len": 10}


SMALL_CHUNKED = ["model=mega_chunk", "model.n_layers=1", "model.d_model=16", "model.mixer.zdim=8", "model.mixer.ndim=2",
                 "model.d_ffn=16"]

TASKS = {
    # task: (fixture writer, extra overrides)
    "listops": (write_listops_fixture, []),
    "text": (fixtures.write_text_fixture, ["data.seq_len=64"]),
    "retrieval": (fixtures.write_retrieval_fixture, ["data.seq_len=64", "model.head=nli"]),
    "image": (fixtures.write_image_fixture, []),
    "pathfinder": (lambda root: fixtures.write_pathfinder_fixture(root, 32), []),
    "pathfinder_gen": (lambda root: fixtures.pathfinder_gen_overrides(), []),
    # 16,384 pixels: a small chunked MEGA keeps the CPU fit short
    "pathx": (lambda root: fixtures.write_pathfinder_fixture(root, 128), [*SMALL_CHUNKED, "model.mixer.chunk_size=1024"]),
    "scifar": (fixtures_extra.write_scifar_fixture, REAL_VALUED),
    # 16,000-sample clips: a small chunked MEGA keeps the CPU fit short
    "sc10": (fixtures_extra.write_sc10_fixture, [*SMALL_CHUNKED, "model.mixer.chunk_size=1000"]),
    "smnist": (fixtures_extra.write_mnist_fixture, REAL_VALUED),
    "pmnist": (fixtures_extra.write_mnist_fixture, REAL_VALUED),
    # the fixture's stream is a few chunks long: K of 2..3 (each equally often an epoch) cut it into the 2 batches
    # a fit takes, where one segment of the recipe's 2..6 could take it whole
    "wikitext103": (fixtures_extra.write_wikitext_fixture, [*LM, "data.k_max=3"]),
    "enwik8": (fixtures_extra.write_enwik8_fixture, LM),
}


@pytest.mark.parametrize("task", [pytest.param(t, marks=pytest.mark.slow) if t in ("pathx", "sc10") else t
                                  for t in sorted(TASKS)])  # pathx / sc10: 16K-long fixtures
def test_transformer_fits_two_steps_on_every_task_fixture(compose, tmp_path, task):
    writer, extra = TASKS[task]
    data_values = writer(tmp_path / "raw")
    model = [o for o in extra if o.startswith("model=")] or ["model=transformer"]
    rest = [o for o in extra if not o.startswith("model=")]
    batch = [] if "task=language_model" in rest else ["data.batch_size=4"]  # LM fixtures size their own streams
    cfg = compose(["~experiment", f"data={task}", *model, *batch, *_data_overrides(data_values), *TINY_TRAINER,
                   *rest])
    metrics = train(cfg)["metrics"]
    assert any(k.startswith("test/") for k in metrics)
