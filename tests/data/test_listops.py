import csv
import sys

import numpy as np
import pytest

from longmixer.data.base import DatasetNotPreparedError
from longmixer.data.generators.listops import ListOpsSpec, evaluate, generate, sample_tree, tree_length, write_tsv_splits
from longmixer.data.listops import VOCAB, GeneratedListOps, ListOps, tokenize
from tests.data.fixtures import orphaned_workers_end

SPEC = ListOpsSpec(num_train=60, num_val=20, num_test=20, max_depth=4, max_args=4, min_length=5, max_length=60)


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = write_tsv_splits(tmp_path / "a", SPEC, seed=3)
    b = write_tsv_splits(tmp_path / "b", SPEC, seed=3)
    c = write_tsv_splits(tmp_path / "c", SPEC, seed=4)
    assert all(a[s].read_bytes() == b[s].read_bytes() for s in a)
    assert a["train"].read_bytes() != c["train"].read_bytes()


def test_worker_count_does_not_change_the_data():
    """The parallel generator draws seeded shards and deduplicates them in shard order, so two processes give
    the serial generator's samples in the serial order."""
    spec = ListOpsSpec(num_train=900, num_val=50, num_test=50, max_depth=4, max_args=4, min_length=5, max_length=60)
    assert list(generate(spec, seed=2, workers=2)) == list(generate(spec, seed=2, workers=1))


def test_constraints_hold_on_every_sample(tmp_path):
    samples = list(generate(SPEC, seed=0))
    assert len({s for s, _ in samples}) == len(samples) == 100  # deduplicated
    for source, target in samples:
        words = source.replace("(", " ").replace(")", " ").split()
        assert SPEC.min_length < len(words) < SPEC.max_length  # strict, as LRA
        assert 0 <= target <= 9
        assert set(words) <= {"[MIN", "[MAX", "[MED", "[SM", "]", *"0123456789"}


def test_operators_evaluate_like_lra():
    tree = ((((("[MED", 1), 2), 7), 8), "]")  # median of 1 2 7 8 = 4.5 -> 4
    assert evaluate(tree) == 4
    tree = (((("[SM", 9), 8), 5), "]")
    assert evaluate(tree) == 2
    nested = (((("[MAX", 1), ((("[MIN", 5), 3), "]")), 2), "]")
    assert evaluate(nested) == 3 and tree_length(nested) == 8  # [MAX 1 [MIN 5 3 ] 2 ]


def test_tree_depth_is_bounded():
    import random

    def depth(t):
        """Operator nesting depth of a node (a leaf is depth 0, an operator with leaf children depth 1)."""
        if not isinstance(t, tuple):
            return 0
        children, node = [], t[0]
        while isinstance(node, tuple):
            children.append(node[1])
            node = node[0]
        return 1 + max(depth(c) for c in children)

    rng = random.Random(0)
    depths = [depth(sample_tree(rng, 1, SPEC)) for _ in range(300)]
    assert max(depths) == SPEC.max_depth - 1  # a node at depth max_depth is forced to be a leaf


@pytest.mark.parametrize("cls", [ListOps, GeneratedListOps])
@pytest.mark.parametrize("seq_len", [0, -5])
def test_a_seq_len_below_one_is_refused(tmp_path, cls, seq_len):
    """Bug: ListOps took `data.seq_len=-5` and cut 5 tokens off the end of every example (`seq[:-5]`), and 0 emptied
    them; a run on a family with no kernel of that length (the Transformer, LaS, LongVQ) trained on them silently."""
    with pytest.raises(ValueError, match=rf"^data.seq_len={seq_len} must be positive \(LRA: 2000\)$"):
        cls(data_dir=tmp_path, seq_len=seq_len)


def test_tokenization_drops_parens_and_renames_close():
    ids = tokenize("( ( ( [MAX 2 ) 9 ) ] )")
    assert [VOCAB[i] for i in ids] == ["[MAX", "2", "9", "X"]


def _write_official(folder, rows_per_split=12):
    folder.mkdir(parents=True)
    for split in ("train", "val", "test"):
        with open(folder / f"basic_{split}.tsv", "w", newline="") as f:
            w = csv.writer(f, delimiter="\t")
            w.writerow(["Source", "Target"])
            for i in range(rows_per_split):
                w.writerow([f"( ( ( [MAX {i % 10} ) 3 ) ] )", max(i % 10, 3)])


def test_official_tsvs_load_into_batches(tmp_path):
    _write_official(tmp_path / "src")
    dm = ListOps(data_dir=tmp_path / "data", source_dir=str(tmp_path / "src"), batch_size=5, seq_len=10)
    with pytest.raises(DatasetNotPreparedError, match="scripts/prepare_data.py listops"):
        dm.setup()
    dm.prepare_data()
    dm.setup()
    assert dm.manifest["splits"]["train"]["count"] == 12
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (5, 4) and batch["mask"].all() and batch["labels"].dtype.is_floating_point is False
    assert len(list(dm.val_dataloader())) == 3  # 12 = 5 + 5 + 2: eval keeps the last batch


def test_corrupt_tsv_names_the_file_and_line(tmp_path):
    _write_official(tmp_path / "src")
    with open(tmp_path / "src" / "basic_val.tsv", "a") as f:
        f.write("( [MIN 1 ] )\tseven\n")
    dm = ListOps(data_dir=tmp_path / "data", source_dir=str(tmp_path / "src"))
    with pytest.raises(ValueError, match=r"basic_val.tsv:14"):
        dm.prepare_data()


def test_deleted_prepared_file_is_reported(tmp_path):
    dm = GeneratedListOps(data_dir=tmp_path, num_train=20, num_val=5, num_test=5, max_depth=3, max_args=3,
                          min_length=3, max_length=20, seq_len=20)
    dm.prepare_data()
    (dm.root / "train.tokens.npy").unlink()
    with pytest.raises(DatasetNotPreparedError, match="incomplete"):
        GeneratedListOps(data_dir=tmp_path, num_train=20, num_val=5, num_test=5, max_depth=3, max_args=3,
                         min_length=3, max_length=20, seq_len=20).setup()


def test_labels_are_not_degenerate():
    labels = np.array([t for _, t in generate(SPEC, seed=1)])
    assert len(np.unique(labels)) >= 5


def test_a_spec_with_too_few_distinct_examples_stops_with_the_fix(monkeypatch):
    """A spec whose length window holds fewer distinct trees than asked for cannot be filled: after a few shards
    that add nothing the generator stops, naming the spec and what to change."""
    import longmixer.data.generators.listops as gen

    monkeypatch.setattr(gen, "SHARD", 32)
    monkeypatch.setattr(gen, "STALL_SHARDS", 3)
    spec = ListOpsSpec(num_train=500, num_val=5, num_test=5, min_length=0, max_length=5)
    with pytest.raises(gen.ListOpsSpecError, match=r"only \d+ distinct examples with 0 < length < 5 .*Widen "
                                                   r"data.min_length / data.max_length"):
        list(generate(spec, seed=0))
    monkeypatch.setattr(gen, "SHARD_TRIES", 200)  # no tree at all in the window: each shard gives up
    with pytest.raises(gen.ListOpsSpecError, match="only 0 distinct examples with 1 < length < 3"):
        list(generate(ListOpsSpec(num_train=5, num_val=1, num_test=1, min_length=1, max_length=3), seed=0))


def test_blank_lines_are_not_examples(tmp_path):
    from longmixer.data.listops import read_tsv

    path = tmp_path / "basic_train.tsv"
    path.write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n\n")
    assert read_tsv(path)[1] == [2]


def _prepare_script():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "prepare_data.py"
    spec = importlib.util.spec_from_file_location("prepare_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_script_reports_a_malformed_source_in_one_line(tmp_path, capsys):
    """`scripts/prepare_data.py` (`make data`) ends with `error: <file:line: what>` and exit 2 for a malformed source
    file, as for a download or integrity error, not with a traceback."""
    module = _prepare_script()
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "val", "test"):
        (src / f"basic_{split}.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t12\n")
    assert module.main(["listops", f"paths.data_dir={tmp_path / 'data'}", f"data.source_dir={src}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "basic_train.tsv:2: expected `<source>\\t<digit 0-9>`" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_end_when_the_generating_process_is_killed():
    """`kill -9` of prepare_data during generation above 20k examples left the spawn pool's workers drawing
    samples. They watch their parent and end within a second of its death."""
    script = ("from longmixer.data.generators.listops import ListOpsSpec, generate\n"
              # long trees: a shard takes seconds, so the shards already queued would keep an orphan busy long
              "spec = ListOpsSpec(num_train=10_000_000, num_val=1, num_test=1, min_length=1500)\n"
              "for i, _ in enumerate(generate(spec, seed=0, workers=2)):\n"
              "    if i == 0: print('started', flush=True)\n")
    started, running = orphaned_workers_end(script, [], timeout_s=2.0)
    assert len(started) >= 2
    assert running == []


def test_prepare_script_without_a_task_names_only_the_task(capsys):
    """`prepare_data.py` with no argument said "the following arguments are required: task, overrides", although
    the overrides are optional (`make data TASK=` with an empty TASK runs it so)."""
    with pytest.raises(SystemExit) as exit_info:
        _prepare_script().main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip().endswith("error: the following arguments are required: task"), err


@pytest.mark.parametrize("argv, expected", [
    pytest.param(["retrieval", "data.seq_len=0"], "data (AAN): data.seq_len=0 must be positive", id="refused"),
    pytest.param(["listops", "data.seq_lem=1"], "data.seq_lem is not a key of data (did you mean data.seq_len?)",
                 id="unknown-key"),
    pytest.param(["listops_gen", "data.num_train=abc"],  # the config check's, against the constructor's annotation
                 "data.num_train='abc' must be a whole number (GeneratedListOps takes num_train: int)",
                 id="not-a-number"),
    pytest.param(["listops_gen", "data.num_train=-5"], "data.num_train=-5 must be a whole number >= 1", id="negative"),
    pytest.param(["listops_gen", "data.num_val=0"], "data.num_val=0 must be a whole number >= 1", id="empty-split"),
    pytest.param(["listops_gen", "data.source_dir=/elsewhere"], "data.source_dir=/elsewhere is not used by "
                 "listops_gen", id="source-dir"),
    pytest.param(["listopz"], "no data config 'listopz' (did you mean listops?)", id="unknown-task"),
])
def test_prepare_script_reports_config_mistakes_in_one_line(tmp_path, capsys, argv, expected):
    """The command's mistakes ended in tracebacks (Hydra's InstantiationException and ConfigCompositionException, a
    TypeError, a bare StopIteration from the generator) or exit 1 for an unknown task, where training reports them
    in one line; listops_gen took data.source_dir without reading it. One line each, exit 2."""
    module = _prepare_script()
    assert module.main([*argv, f"paths.data_dir={tmp_path / 'data'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and len(err.strip().splitlines()) == 1, err
