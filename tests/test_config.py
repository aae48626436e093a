"""The config layer rejects every bad input with a BadInput naming the key/file, and round-trips."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from conftest import load_config, train_here
from data import DATASETS
from loop.config.fields import opt, to_dict
from loop.config.load import build, changed_keys, config_hash, flat, parse_args, read, save
from loop.config.runtime import follow_global_batch
from loop.config.schema import Config, ModelSection
from loop.errors import EXIT_BAD_INPUT, BadInput
from model import MODELS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
NAMES = "data:\n  name: text\nmodel:\n  name: gpt\n"  # what a config file chooses, beside the keys tested


def bad(overrides=(), path=DEFAULT) -> str:
    """The BadInput message load_config raises for these inputs."""
    with pytest.raises(BadInput) as e:
        load_config(path, list(overrides))
    return str(e.value)


# ------------------------------------------------------------------------------- error paths
@pytest.mark.parametrize("item, key, suggestion", [
    ("optim.lrr=1", "optim.lrr", "optim.lr"),  # a typo: the spelling neighbour
    ("train.lr=1", "train.lr", "optim.lr"),  # right name, wrong section
    ("train.max_stepz=3", "train.max_stepz", "train.max_steps"),
    ("schedule.warmup=3", "schedule.warmup", "schedule.warmup_steps"),
    ("data.markov.vocab=3", "data.markov.vocab", "data.markov.vocab_size"),
])
def test_unknown_cli_key_names_it_and_suggests(item, key, suggestion):
    msg = bad(["data.name=markov", item])
    assert f"'{key}'" in msg
    assert f"Did you mean '{suggestion}'?" in msg


def test_unknown_yaml_key_names_it_and_suggests(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(NAMES + "optim:\n  lr: 0.1\n  lrr: 1\n")
    msg = bad(path=f)
    assert "'optim.lrr'" in msg and "Did you mean 'optim.lr'?" in msg

    f.write_text(NAMES + "train:\n  lr: 0.1\n")
    assert "Did you mean 'optim.lr'?" in bad(path=f)

    f.write_text(NAMES + "trian:\n  max_steps: 1\n")
    msg = bad(path=f)  # a misspelt section: named, and the sections are listed
    assert "'trian'" in msg and "Did you mean 'train'?" in msg
    assert "Known sections: run, data, model, optim, schedule, train" in msg

    for section, key in [("train", "max_steps"), ("model", "n_layer"), ("data", "seq_len")]:
        f.write_text(NAMES + f"{section}.{key}: 3\n")  # a command line's dotted key: said how to nest it
        msg = bad(path=f)
        assert f"'{section}.{key}'" in msg and f"nest it: {section}: then {key}:" in msg, msg
        assert "Did you mean" not in msg


def test_nested_path_below_a_leaf_is_unknown():
    msg = bad(["data.seq_len.x=3"])
    assert "'data.seq_len.x'" in msg and "Did you mean 'data.seq_len'?" in msg


@pytest.mark.parametrize("item, key, expected, given", [
    ("train.max_steps=abc", "train.max_steps", "expected int", "got 'abc' (str)"),
    ("train.max_steps=1.5", "train.max_steps", "expected int", "got 1.5 (float)"),
    ("train.max_steps=true", "train.max_steps", "expected int", "got True (bool)"),
    ("model.bias=3", "model.bias", "expected bool", "got 3 (int)"),
    ("optim.lr=fast", "optim.lr", "expected float", "got 'fast' (str)"),
    ("optim.lr=true", "optim.lr", "expected float", "got True (bool)"),
    ("optim.betas=0.8", "optim.betas", "expected a list of float", "got 0.8 (float)"),
    ("optim.betas=[a,0.9]", "optim.betas.0", "expected float", "got 'a' (str)"),
    ("data.markov=3", "data.markov", "expected MarkovConfig", "got 3 (int)"),
])
def test_wrong_type_names_key_expected_and_given(item, key, expected, given):
    msg = bad(["data.name=markov", item])
    assert msg == f"config key {key}: {expected}, {given}."


def test_wrong_type_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(NAMES + "train:\n  max_steps: abc\n")
    assert bad(path=f) == "config key train.max_steps: expected int, got 'abc' (str)."
    f.write_text(NAMES + "train: 3\n")
    msg = bad(path=f)
    assert "config train in" in msg and str(f) in msg and "expected a mapping" in msg


def test_out_of_range_and_bad_choice():
    assert bad(["train.grad_accum=0"]) == "config key train.grad_accum: expected a value >= 1, got 0."
    assert bad(["optim.lr=-1e-3"]) == "config key optim.lr: expected a value >= 0.0, got -0.001."
    assert bad(["data.name=markov", "data.markov.tokens=999"]) == \
        "config key data.markov.tokens: expected a value >= 1000, got 999."
    assert bad(["train.precision=fp8"]) == \
        "config key train.precision: expected one of auto, bf16, fp16, fp32; got 'fp8'."
    # Seeds NumPy takes (0 to 2**32 - 1): checked here, or NumPy's ValueError tracebacks come after
    # the checks.
    assert bad(["run.seed=-1"]) == "config key run.seed: expected a value >= 0, got -1."
    assert bad(["run.seed=4294967296"]) == \
        "config key run.seed: expected a value <= 4294967295, got 4294967296."
    assert bad(["data.name=random", "data.synthetic.seed=-1"]) == "config key data.synthetic.seed: expected a value >= 0, got -1."
    # A fault's rank: -1 is every rank; below it, no rank at all (a drill that never fires).
    assert bad(["faults.nan_rank=-2"]) == "config key faults.nan_rank: expected a value >= -1, got -2."
    assert bad(["faults.oom_at_step=-5"]) == "config key faults.oom_at_step: expected a value >= -1, got -5."
    # train.keep_last=0 would keep every checkpoint (store.prune's [:-0] is empty), filling the disk.
    for key in ("train.keep_last", "train.max_bad_steps"):
        said = bad([f"{key}=0"])
        assert key in said and ">= 1" in said, said
    # A batch's count past 64 bits: exit 2, not a ValueError traceback from islice once out_dir is made.
    assert bad(["data.batch_size=100000000000000000000"]) == \
        "config key data.batch_size: expected a value <= 9223372036854775807, got 100000000000000000000."
    for key in ("train.grad_accum", "train.global_batch", "train.eval_batches"):
        assert "expected a value <= 9223372036854775807" in bad([f"{key}=100000000000000000000"]), key


def test_a_float_key_refuses_nan_and_infinity(tmp_path):
    # nan passes every bound (nan < 0 is False): unrefused, optim.lr=nan reaches AdamW's ValueError,
    # and train.clip_grad=nan, ema.decay=nan or schedule.min_lr_ratio=nan train on without a word.
    for text in ("nan", "inf", "-inf"):
        assert bad([f"train.clip_grad={text}"]) == \
            f"config key train.clip_grad: expected a finite number, got '{text}'."
    assert bad(["optim.betas.1=nan"]) == "config key optim.betas.1: expected a finite number, got 'nan'."
    f = tmp_path / "c.yaml"
    f.write_text(NAMES + "ema:\n  decay: .nan\noptim:\n  lr: .inf\n")  # YAML's own spellings
    assert bad(path=f) == "config key ema.decay: expected a finite number, got nan."


def test_upper_bounds_and_list_elements():
    # Each would otherwise reach PyTorch (a ValueError from nn.Dropout or AdamW, an IndexError)
    # or train on silently (an EMA decay above 1 diverges, a cosine floor above the peak).
    assert bad(["model.dropout=1.5"]) == "config key model.dropout: expected a value <= 1.0, got 1.5."
    assert bad(["ema.decay=1.01"]) == "config key ema.decay: expected a value <= 1.0, got 1.01."
    assert bad(["schedule.min_lr_ratio=2"]) == \
        "config key schedule.min_lr_ratio: expected a value <= 1.0, got 2.0."
    assert bad(["optim.betas.1=1"]) == "config key optim.betas.1: expected a value < 1.0, got 1.0."
    # AdamW divides by sqrt(v) + eps: with eps 0 a weight whose gradient is 0 becomes NaN at the
    # first step (any optim.lr, 0 too), and the run skips every step after it.
    assert bad(["optim.eps=0"]) == "config key optim.eps: expected a value > 0.0, got 0.0."
    assert bad(["optim.betas=[0.9, -0.1]"]) == \
        "config key optim.betas.1: expected a value >= 0.0, got -0.1."
    assert bad(["optim.betas=[0.9]"]) == \
        "config key optim.betas: expected a list of 2 values, got [0.9] (list)."
    cfg = load_config(DEFAULT, ["model.dropout=1", "ema.decay=1", "optim.betas=[0, 0.999]", "optim.eps=1e-30"])
    # The Markov chain is a dense vocab x vocab matrix: 10**20 is refused here, not left to numpy's
    # ValueError after the checks.
    assert bad(["data.name=markov", "data.markov.vocab_size=99999999999999999999"]) == \
        "config key data.markov.vocab_size: expected a value <= 1024, got 99999999999999999999."
    assert (cfg.model.dropout, cfg.ema.decay, cfg.optim.betas, cfg.optim.eps) == (1.0, 1.0, [0.0, 0.999], 1e-30)
    # added to an int64 tensor at the first EMA update: an OverflowError after the run's files
    assert bad(["ema.warmup=99999999999999999999"]).startswith("config key ema.warmup: expected a value <=")


def test_integers_are_decimal_in_files_and_overrides(tmp_path):
    # YAML 1.1 reads 010 as 8 (octal) and 1:30 as 90 (base 60): read that way, train.max_steps=010
    # would train 8 steps, and seed: 0042 in a file would record seed 34.
    for text in ("010", "1:30", "0x10"):
        assert bad([f"train.max_steps={text}"]) == f"config key train.max_steps: expected int, got '{text}' (str)."
    f = tmp_path / "c.yaml"
    f.write_text(NAMES + "run:\n  seed: 0042\n")
    assert bad(path=f) == "config key run.seed: expected int, got '0042' (str)."
    cfg = load_config(DEFAULT, ["train.max_steps=1_000", "run.seed=0", "optim.lr=1e-3"])
    assert (cfg.train.max_steps, cfg.run.seed, cfg.optim.lr) == (1000, 0, 1e-3)
    # Floats too: 1:30.0 is not 90.0; the decimal forms still read as numbers.
    assert bad(["optim.lr=1:30.0"]) == "config key optim.lr: expected float, got '1:30.0' (str)."
    f.write_text(NAMES + "optim:\n  lr: 1:30.0\n")
    assert bad(path=f) == "config key optim.lr: expected float, got '1:30.0' (str)."
    f.write_text(NAMES + "optim:\n  lr: .5\n  eps: 1.0e-8\n  betas: [0.9, 0.]\n")
    cfg = load_config(f, [])
    assert (cfg.optim.lr, cfg.optim.eps, cfg.optim.betas) == (0.5, 1e-8, [0.9, 0.0])
    # An explicit tag is held to the same rule: !!int 010 is not 8, !!float 1:30 not 90.0.
    assert bad(["train.max_steps=!!int 010"]) == "config key train.max_steps: expected int, got '010' (str)."
    assert bad(["optim.lr=!!float 1:30"]) == "config key optim.lr: expected float, got '1:30' (str)."
    assert load_config(DEFAULT, ["optim.lr=!!float 1"]).optim.lr == 1.0


def test_a_dot_and_underscores_is_text_that_its_config_yaml_reruns(tmp_path):
    # `._` matched the float pattern, which PyYAML's float constructor cannot read (a ValueError
    # traceback), while PyYAML's dumper wrote it unquoted: a run with run.out_dir=._ could not
    # rerun its own config.yaml.
    assert bad(["optim.lr=._"]) == "config key optim.lr: expected float, got '._' (str)."
    cfg = load_config(DEFAULT, ["run.out_dir=._"])
    save(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", []) == cfg
    assert load_config(DEFAULT, ["optim.lr=.5_0"]).optim.lr == 0.5
    f = tmp_path / "c.yaml"  # other values YAML cannot read: no date 2024-13-45, lists 1,000 deep
    for text in ("run:\n  seed: 2024-13-45\n", "train: " + "[" * 1000 + "]" * 1000 + "\n"):
        f.write_text(NAMES + text)
        assert bad(path=f).startswith(f"config file {f}: a value YAML cannot read")
    assert bad(["run.seed=2024-13-45"]) == "config key run.seed: expected int, got '2024-13-45' (str)."
    assert bad(["run.seed=" + "[" * 1000 + "]" * 1000]).startswith("config key run.seed: expected int")


def test_none_words_for_a_key_whose_none_is_empty_are_refused():
    # Taken as a path, run.mirror=none would mirror into ./none, and the next run on that "mirror"
    # would continue from it.
    for key in ("run.mirror", "run.init_from", "data.path", "data.url"):
        for word in ("none", "None", "null", "off", "false"):
            assert bad(["data.name=mnist", f"{key}={word}"]) == (f"config key {key}: {word!r} would be taken as a path called "
                                              f"{word}; expected a path, or {key}= (empty) for none.")
    assert load_config(DEFAULT, ["run.mirror="]).run.mirror == ""


def test_a_config_file_is_held_to_what_overrides_are(tmp_path):
    # A none word, a float past float's range, a NUL in a path, a name that is not a name, a
    # section that is not a mapping: each refused by key, as on the command line.
    f = tmp_path / "c.yaml"
    for text, message in [
            ("run:\n  mirror: none\n", "config key run.mirror: 'none' would be taken as a path called none"),
            (f"optim:\n  lr: 1{'0' * 400}\n", "config key optim.lr: expected a finite number"),
            ('run:\n  out_dir: "a\\0b"\n', "config key run.out_dir: expected text without a NUL character"),
            ("data:\n  name: [text]\nmodel:\n  name: gpt\n", "config key data.name: expected one of text,"),
            ("data: text\nmodel:\n  name: gpt\n", f"config data in {f}: expected a mapping of keys, got 'text'.")]:
        f.write_text(text if text.startswith("data") else NAMES + text)
        assert bad(path=f).startswith(message), text
    assert bad([f"optim.lr=1{'0' * 400}"]).startswith("config key optim.lr: expected a finite number")


def test_a_path_starting_with_a_tilde_is_in_the_home_directory(tmp_path, monkeypatch):
    # Given through make's ARGS or a YAML file, no shell expands it: the loop does, so no directory
    # named ~ is made here.
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(DEFAULT, ["run.out_dir=~/runs/a", "data.cache_dir=~/cache", "run.mirror=~/bucket"])
    assert (cfg.run.out_dir, cfg.data.cache_dir, cfg.run.mirror) == (
        f"{tmp_path}/runs/a", f"{tmp_path}/cache", f"{tmp_path}/bucket")


def test_output_and_cache_dirs_must_be_directories_that_can_be_made(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("kept")
    for key in ("run.out_dir", "data.cache_dir"):
        assert bad([f"{key}={f}"]) == (f"config key {key}={f}: {f} is a file; expected a directory, "
                                       f"or a path where one can be made.")
        assert bad([f"{key}={f}/sub/dir"]).startswith(f"config key {key}={f}/sub/dir: {f} is a file;")
        assert bad([f"{key}="]) == f"config key {key}: expected a directory path, got ''."
    # A link to a directory not there (an unmounted disk): named, not left to mkdir, which meets it
    # with a FileExistsError traceback.
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for key in ("run.out_dir", "data.cache_dir"):
        for path in (tmp_path / "link", tmp_path / "link" / "run"):
            assert bad([f"{key}={path}"]) == (
                f"config key {key}={path}: {tmp_path / 'link'} is a symbolic link to {tmp_path / 'gone'}, "
                f"which does not exist; expected a directory, or a path where one can be made.")
    cfg = load_config(DEFAULT, [f"run.out_dir={tmp_path}/new/run", f"data.cache_dir={tmp_path}"])
    assert cfg.run.out_dir == f"{tmp_path}/new/run" and f.read_text() == "kept"
    # A name in another encoding (Latin-1 bytes, a surrogate to Python): TensorBoard's writer
    # failed on it after the run's first files were written.
    latin = f"{tmp_path}/caf\udce9"
    for key in ("run.out_dir", "data.cache_dir"):
        assert bad([f"{key}={latin}"]).startswith(f"config key {key}={latin!r}: not UTF-8 text")
    long = tmp_path / ("a" * 300)  # one name over the file system's 255 bytes: not an OSError traceback
    for key in ("run.out_dir", "data.cache_dir"):
        assert bad([f"{key}={long}"]) == f"config key {key}={long}: File name too long; expected a directory path."


def test_list_index_out_of_range():
    assert bad(["optim.betas.2=0.9"]) == "config key optim.betas.2: index 2 is not in a list of 2."
    assert bad(["optim.betas.x=0.9"]) == "config key optim.betas.x: index x is not in a list of 2."
    for digit in ("\u00b2", "\u0661"):  # digits to str.isdigit(), not to int() or not ASCII: refused
        assert bad([f"optim.betas.{digit}=0.5"]) == \
            f"config key optim.betas.{digit}: index {digit} is not in a list of 2."


def test_malformed_yaml_names_file_and_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("run:\n  seed: 1\ntrain:\n  max_steps: 3: 4\n")  # error on line 4
    msg = bad(path=f)
    assert msg.startswith(f"config file {f} line 4, column ")
    assert "malformed YAML" in msg

    f.write_text("optim:\n  betas: [0.9, 0.95\nrun:\n  seed: 1\n")  # unclosed list
    msg = bad(path=f)
    assert str(f) in msg and " line " in msg and "malformed YAML" in msg


def test_a_config_that_is_not_utf8_text_names_the_file(tmp_path):
    # A binary file (or Latin-1 text) given as --config: named, not a UnicodeDecodeError traceback
    # (exit 1).
    f = tmp_path / "binary.yaml"
    f.write_bytes(b"train:\n  max_steps: 3\n\xff\xfe t: 1\n")
    assert bad(path=f) == f"config file {f}: byte 22 is not UTF-8 text; expected a YAML file."


def test_a_key_given_twice_in_yaml_names_both_lines(tmp_path):
    # YAML keeps the last of two equal keys without a word: a second `train:` section would drop
    # every key of the first (here max_steps: 3 would become the default).
    f = tmp_path / "twice.yaml"
    f.write_text(NAMES + "train:\n  max_steps: 3\noptim:\n  lr: 0.01\ntrain:\n  grad_accum: 2\n")
    assert bad(path=f) == (f"config file {f} line 9, column 1: malformed YAML (key 'train' given "
                           f"twice, first on line 5; YAML would keep the second and drop the first "
                           f"without a word).")
    f.write_text(NAMES + "optim:\n  lr: 0.01\n  lr: 0.02\n")  # within a section too
    assert "line 7, column 3: malformed YAML (key 'lr' given twice, first on line 6;" in bad(path=f)
    # A merge key (<<) is not a duplicate: the explicit key overrides the merged one, as YAML says.
    f.write_text(NAMES + "train:\n  <<: {max_steps: 3, grad_accum: 2}\n  max_steps: 5\n")
    assert (load_config(f).train.max_steps, load_config(f).train.grad_accum) == (5, 2)


def test_missing_config_file(tmp_path, monkeypatch):
    missing = tmp_path / "nope.yaml"
    msg = bad(path=missing)
    assert msg == f"config file {missing}: cannot read it (No such file or directory); expected a YAML file."
    monkeypatch.chdir(tmp_path)  # a relative path: the message says where it was looked for
    assert bad(path="configs/mine.yaml") == (
        f"config file configs/mine.yaml: cannot read it (No such file or directory, looked for in "
        f"{tmp_path}); expected a YAML file.")


def test_the_default_config_is_found_from_any_directory(tmp_path, monkeypatch):
    # python ~/proj/train.py from another directory: the default is the project's, the run's
    # relative paths stay relative to where it was started.
    monkeypatch.chdir(tmp_path)
    path, _ = parse_args([], DATASETS, MODELS)
    assert load_config(path) == load_config(DEFAULT)
    assert not Path(load_config(path).run.out_dir).is_absolute()


@pytest.mark.parametrize("item", ["optim.lr", "=3", ""])
def test_override_without_equals(item):
    assert bad([item]) == f"override '{item}': expected the form section.key=value."


def test_a_config_file_given_without_config_flag_says_how_to_give_it():
    assert bad(["configs/mnist.yaml"]) == ("override 'configs/mnist.yaml': expected the form "
                                           "section.key=value (a config file is given as --config PATH).")


def test_a_key_with_nothing_after_the_equals_sign_says_so():
    # Said as an empty value, not "got None (NoneType)" (YAML reads an empty value as null). A
    # string key takes "".
    assert bad(["train.max_steps="]) == "config key train.max_steps: expected int, got an empty value."
    assert load_config(DEFAULT, ["data.path="]).data.path == ""


def test_an_empty_config_path_is_named_as_empty_not_as_the_working_directory():
    # `--config $UNSET`: Path("") is ".", which read() called a directory.
    msg = bad(path="")
    assert msg.startswith("config file '' (--config): an empty path"), msg


def test_help_lists_every_key_with_what_python_train_py_uses(capsys):
    # --help lists every key, not only --config and "overrides", with the value `python train.py`
    # uses: the default config file's where it sets one, not the dataclasses' default.
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"], DATASETS, MODELS)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "config keys, as section.key=value" in out
    words = set(out.split())
    assert {"out_dir=runs/default", "betas=[0.9,0.95]", "deterministic=false", "markov.vocab_size=32",
            "break=", "name=text", "name=gpt"} <= words, out
    default = load_config(DEFAULT)
    assert re.search(rf"^  optim: lr={default.optim.lr} weight_decay=0.1 ", out, re.M), out

    listed, section = [], None
    for line in out.split("config keys")[1].splitlines()[1:]:
        head, sep, rest = line.partition(": ")
        if head.strip().startswith("or "):  # another data set's or model's own keys
            section = None
            continue
        if sep and head.startswith("  ") and not head.startswith("   "):  # "  optim: lr=..."
            section, line = head.strip(), rest
        listed += [f"{section}.{word.split('=')[0]}" for word in line.split()] if section else []
    assert listed == list(flat(to_dict(default)))  # every key of the default run, once, in order


def test_the_default_config_sets_nothing_but_the_data_set_and_the_model():
    # One source of defaults: the dataclasses. A default config file that set optim.lr=2e-3 where
    # they say 1e-3 would have --help show one value while `python train.py` uses the other.
    from loop.config.builders import options_of
    from loop.config.load import read

    assert read(DEFAULT) == {"data": {"name": "text"}, "model": {"name": "gpt"}}
    plain = {**to_dict(Config()), "data": to_dict(options_of("data", "text", DATASETS["text"])(name="text")),
             "model": to_dict(options_of("model", "gpt", MODELS["gpt"])(name="gpt"))}
    assert to_dict(load_config(DEFAULT)) == plain


def test_config_given_twice_is_refused(capsys):
    # Left to argparse, the last --config would be kept and the first dropped without a word.
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", "a.yaml", "train.max_steps=3", "--config", "b.yaml"], DATASETS, MODELS)
    assert e.value.code == 2
    assert "error: argument --config: given twice; expected one file" in capsys.readouterr().err
    assert parse_args(["--config", "a.yaml"], DATASETS, MODELS) == ("a.yaml", [])


# ------------------------------------------------------------------------------- overrides
def test_nested_list_and_float_overrides():
    base = load_config(DEFAULT, ["data.name=markov"])
    cfg = load_config(DEFAULT, ["data.name=markov", "data.markov.vocab_size=7", "optim.betas=[0.8,0.9]",
                                "optim.lr=3e-4"])
    assert cfg.data.markov.vocab_size == 7 and type(cfg.data.markov.vocab_size) is int
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.optim.lr == 0.0003 and type(cfg.optim.lr) is float  # PyYAML reads 3e-4 as a str
    assert base.data.markov.vocab_size == 32 and base.optim.betas == [0.9, 0.95]

    cfg = load_config(DEFAULT, ["optim.betas.1=0.99"])
    assert cfg.optim.betas == [0.9, 0.99]
    cfg = load_config(DEFAULT, ["optim.betas=[0, 0]"])  # ints in a list of float become floats
    assert cfg.optim.betas == [0.0, 0.0] and all(type(b) is float for b in cfg.optim.betas)
    cfg = load_config(DEFAULT, ["optim.lr=1"])
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float


def test_later_override_wins_and_strings_stay_verbatim():
    cfg = load_config(DEFAULT, ["train.max_steps=5", "train.max_steps=7", "run.out_dir=007",
                                "run.resume=never", "data.path=1e3"])
    assert cfg.train.max_steps == 7
    assert cfg.run.out_dir == "007" and cfg.data.path == "1e3"  # not 7 / 1000.0


def test_yaml_values_are_loaded():
    cfg = load_config(DEFAULT)
    assert cfg.optim.lr == 2.0e-3 and cfg.model.n_layer == 4 and cfg.data.seq_len == 128
    assert cfg.model.bias is False and cfg.schedule.name == "warmup_cosine"


def test_an_empty_config_file_is_refused_and_an_empty_section_gives_defaults(tmp_path):
    # An empty file (or `0`, `~`) is refused: it would run on the defaults, also into an existing
    # run directory, which it would resume and change.
    f = tmp_path / "c.yaml"
    for text, what in (("", "it is empty"), ("0\n", "it holds int '0'"), ("~\n", "it is empty"),
                       ("- a\n", "it holds list")):
        f.write_text(text)
        assert bad(path=f).startswith(f"config file {f}: {what}"), text
    f.write_text(NAMES + "train:\n")
    assert load_config(f) == load_config(DEFAULT)


def test_save_then_load_is_equal(tmp_path):
    cfg = load_config(DEFAULT, ["optim.lr=3e-4", "optim.betas.1=0.99", "data.name=markov", "data.markov.vocab_size=7",
                                "run.out_dir=007", "model.bias=true", "train.precision=bf16",
                                "schedule.name=step", "optim.eps=1e-12", "data.val_fraction=0.25",
                                "faults.nan_at_step=3"])
    out = tmp_path / "saved.yaml"
    save(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)
    assert again.run.out_dir == "007" and again.optim.eps == 1e-12 and again.model.bias is True
    assert again != load_config(DEFAULT)  # the comparison can fail


def test_the_config_hash_changes_with_any_key_of_any_section():
    # metadata.json's and each checkpoint's config_sha256 names the config: two runs whose configs
    # differ in one key, of whichever section, must not share it.
    one_per_section = ["run.seed=1", "data.num_workers=1", "model.activation_checkpointing=true",
                       "optim.lr=0.1", "schedule.warmup_steps=3", "train.max_steps=7", "ema.enabled=true",
                       "report.plots=false", "faults.nan_at_step=2", "lab.break=no_rng_restore"]
    assert {key.split(".")[0] for key in one_per_section} == set(to_dict(Config()))
    hashes = {config_hash(load_config(DEFAULT, [item])) for item in ["run.seed=1337", *one_per_section]}
    assert len(hashes) == 1 + len(one_per_section)


# ------------------------------------------------------------------------------- train.py exit 2
def run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_train_py_unknown_key_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "x"
    r = run_train(f"run.out_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "train.max_stepz=3")
    assert r.returncode == EXIT_BAD_INPUT == 2, r.stderr
    assert "train.max_steps" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: unknown config key 'train.max_stepz'")
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_train_py_malformed_yaml_exits_2(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("train:\n  max_steps: [3\n")
    out = tmp_path / "x"
    r = run_train("--config", str(f), f"run.out_dir={out}")
    assert r.returncode == 2, r.stderr
    assert str(f) in r.stderr and "malformed YAML" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_train_py_missing_data_path_exits_2(tmp_path):
    out, missing, cache = tmp_path / "x", tmp_path / "no_such.txt", tmp_path / "cache"
    r = run_train(f"run.out_dir={out}", f"data.path={missing}", f"data.cache_dir={cache}")
    assert r.returncode == 2, r.stderr
    assert str(missing) in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() and not cache.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_overrides_before_and_after_config():
    # `make train ARGS=...` and make verify put overrides on both sides of --config.
    assert parse_args(["train.max_steps=3", "--config", "x.yaml", "optim.lr=0.1"], DATASETS, MODELS) == \
        ("x.yaml", ["train.max_steps=3", "optim.lr=0.1"])


def test_changed_keys_names_keys_either_config_lacks():
    # A checkpoint from older (or newer) code: a key only one side has is a change, said at the
    # resume; looking only at the checkpoint's keys would miss the keys this code added since.
    old = to_dict(Config())
    old["train"]["max_steps"] = 7
    del old["train"]["keep_last"]  # older code: no such key yet
    old["train"]["retired"] = 1  # newer code's key, gone here
    assert changed_keys(old, Config()) == ["train.keep_last", "train.max_steps", "train.retired"]


def test_an_integer_longer_than_python_reads_is_exit_2_naming_the_key(tmp_path):
    # 4,301 digits is past Python's limit for reading an integer: a ValueError traceback, exit 1,
    # from the override and from the YAML loader alike.
    long = "1" * 4301
    assert bad([f"train.max_steps={long}"]) == ("config key train.max_steps: expected an integer of at most "
                                                "4,300 digits (Python reads no longer one); got one of 4,301 digits.")
    assert bad([f"optim.lr={'1' * 100_000}"]).startswith("config key optim.lr: expected a finite number, got '111")
    f = tmp_path / "c.yaml"
    f.write_text(NAMES + f"train:\n  max_steps: {long}\n")
    assert bad(path=f).startswith("config key train.max_steps: expected an integer of at most 4,300 digits")
    assert load_config(DEFAULT, [f"train.max_steps={'9' * 20}"]).train.max_steps == int("9" * 20)


def test_the_done_line_names_every_validation_metric(tmp_path, cache):
    # A classifier's val_accuracy was in summary.json only; the console said "val 0.0512".
    from conftest import train_here

    proc = train_here(tmp_path / "run", cache, "train.max_steps=2")
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    assert " | val_loss " in done and " | val " not in done, done


def test_a_global_batch_sets_the_accumulation_or_names_what_would_divide_it(tmp_path, cache):
    cfg = load_config(DEFAULT, ["train.global_batch=64", "data.batch_size=8", "train.grad_accum=3"])
    assert follow_global_batch(cfg, 2) == ("train.global_batch=64: train.grad_accum=4 (2 process(es) x "
                                           "data.batch_size 8 x 4)") and cfg.train.grad_accum == 4
    unset = load_config(DEFAULT, ["train.grad_accum=3"])
    assert follow_global_batch(unset, 2) is None and unset.train.grad_accum == 3
    for world, fix in ((1, "a data.batch_size that divides 60"), (7, "a train.global_batch that is a multiple of 7")):
        with pytest.raises(BadInput) as e:
            follow_global_batch(load_config(DEFAULT, ["train.global_batch=60", "data.batch_size=8"]), world)
        assert "train.global_batch=60" in str(e.value) and fix in str(e.value)
    # 64 samples are 8 micro-batches of 8, but not a whole number of them on each of 3 processes:
    # refused, not trained as 2 x 3 x 8 = 48 samples a step.
    with pytest.raises(BadInput) as e:
        follow_global_batch(load_config(DEFAULT, ["train.global_batch=64", "data.batch_size=8"]), 3)
    assert "data.batch_size=8 x 3 process(es) = 24" in str(e.value)
    # Bad input: exit 2 with the key named, before anything is written.
    proc = train_here(tmp_path / "run", cache, "train.global_batch=6", check=False)
    assert proc.returncode == 2 and "train.global_batch=6" in proc.stderr and not (tmp_path / "run").exists()


@dataclasses.dataclass
class MaybeOptions(ModelSection):
    KIND: typing.ClassVar[str] = "maybe"  # a class attribute, no key
    layers: int | None = opt(None, min=1)  # none: the model picks
    tag: typing.Optional[str] = None  # noqa: UP045 (the older spelling is taken too)
    act: str | None = opt(None, choices=["relu", "gelu"])
    weights: str | None = opt(None, path="file")
    width: int | None = opt("auto", auto=True)


@dataclasses.dataclass
class TupleOptions(ModelSection):
    shape: tuple[int, ...] = (64, 64)


def build_maybe(cfg: MaybeOptions, data):
    return None


def build_tuple(cfg: TupleOptions, data):
    return None


def build_without_data(cfg: ModelSection):
    return None


def test_a_key_typed_x_or_none_takes_none_and_x_and_its_config_yaml_reruns(tmp_path):
    def load(raw, *overrides):
        return build(raw, "test", ["data.name=text", "model.name=maybe", *overrides], DATASETS,
                     {**MODELS, "maybe": build_maybe})

    assert (load({}).model.layers, load({}).model.tag) == (None, None)
    cfg = load({}, "model.layers=3", "model.tag=007")
    assert (cfg.model.layers, cfg.model.tag) == (3, "007")  # text stays text: 007, not 7
    for empty in ("", "none", "null", "~", "None", "NULL"):  # in any case: None as Python writes it
        cfg = load({}, "model.layers=3", "model.tag=x", f"model.layers={empty}", f"model.tag={empty}")
        assert (cfg.model.layers, cfg.model.tag) == (None, None), empty
    save(load({}), tmp_path / "config.yaml")  # layers: null, as a run's config.yaml holds it
    assert load(read(tmp_path / "config.yaml")).model.layers is None
    assert load(read(tmp_path / "config.yaml"), "model.layers=2").model.layers == 2
    with pytest.raises(BadInput, match=r"model\.layers: expected int or none"):
        load({}, "model.layers=abc")
    with pytest.raises(BadInput, match=r"model\.layers: expected a value >= 1, got 0"):
        load({}, "model.layers=0")  # the bounds hold for a value, none passes them
    assert (load({}).model.act, load({}).model.weights, load({}).model.width) == (None, None, "auto")
    with pytest.raises(BadInput, match=r"model\.act: expected one of relu, gelu"):
        load({}, "model.act=tanh")
    assert load({}, "model.weights=~/w.pt").model.weights.endswith("/w.pt")  # ~ expanded as ever
    with pytest.raises(BadInput, match=r"model\.width: expected int or auto"):
        load({}, "model.width=abc")


def test_a_key_of_a_type_no_config_takes_is_refused_naming_it():
    models = {**MODELS, "t": build_tuple}
    with pytest.raises(BadInput, match=r"model\.shape .*tuple.*expected bool, int, float, str.*list"):
        build({}, "test", ["data.name=text", "model.name=t"], DATASETS, models)
    # Only where chosen: a run of another model, its typo's hint, and --help are as without it.
    assert build({}, "test", ["data.name=text", "model.name=gpt"], DATASETS, models).model.name == "gpt"
    with pytest.raises(BadInput, match=r"Did you mean 'model\.n_layer'"):
        build({}, "test", ["data.name=text", "model.name=gpt", "model.n_layr=3"], DATASETS, models)


@dataclasses.dataclass
class Unrelated:  # a dataclass, but not a ModelSection: the loop's model keys would be missing
    width: int = 4


def build_unrelated(cfg: Unrelated, data):
    return None


def test_options_that_do_not_extend_the_section_are_refused_naming_the_base():
    with pytest.raises(BadInput) as e:
        build({}, "test", ["data.name=text", "model.name=odd"], DATASETS, {**MODELS, "odd": build_unrelated})
    assert str(e.value).startswith("config key model.name=odd: its builder build_unrelated takes ")
    assert "expected a dataclass that extends loop.config.schema.ModelSection" in str(e.value)


def test_another_builder_s_key_names_the_chosen_builder_s_own_keys_and_the_builders_that_read_it():
    # The loop's keys (data.batch_size, ...) are every builder's: not listed as the chosen one's.
    msg = bad(["data.url=x"])
    reads = msg.split("data.name=text reads ")[1].split(", not this one")[0].split(", ")
    assert sorted(reads) == ["data.cache_dir", "data.path", "data.seq_len", "data.val_fraction"], msg
    readers = msg.split("data.url is for data.name=")[1].split(".")[0].split(", ")
    assert sorted(readers) == ["mnist", "shakespeare"], msg


def test_a_builder_that_cannot_be_called_as_the_loop_calls_it_is_refused_naming_it():
    with pytest.raises(BadInput, match=r"model\.name=one: .*build_without_data\(options, data\)"):
        build({}, "test", ["data.name=text", "model.name=one"], DATASETS, {**MODELS, "one": build_without_data})


@dataclasses.dataclass(kw_only=True)
class NoDefault(ModelSection):  # kw_only lets a field without a default follow the section's
    depth: int


def build_no_default(cfg: NoDefault, data):
    return None


def test_a_broken_builder_fails_only_the_run_that_chooses_it():
    # Another name's builder (options not a section, a field without a default) is not a run of
    # model.name=gpt's problem: its --help, its run and its typo's hint are as without it.
    models = {**MODELS, "odd": build_unrelated, "nodefault": build_no_default}
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"], DATASETS, models)
    assert e.value.code == 0
    assert build({}, "test", ["data.name=text", "model.name=gpt"], DATASETS, models).model.name == "gpt"
    with pytest.raises(BadInput, match=r"Did you mean 'model\.n_layer'"):
        build({}, "test", ["data.name=text", "model.name=gpt", "model.n_layr=3"], DATASETS, models)
    # Chosen: exit 2 naming the key without a default, not cls()'s TypeError traceback.
    with pytest.raises(BadInput, match=r"^config key model\.depth \(model\.name=nodefault\): no default"):
        build({}, "test", ["data.name=text", "model.name=nodefault"], DATASETS, models)


def test_a_keyword_key_is_spelled_as_users_write_it_not_as_its_field():
    # lab.break is held in a field named break_; lab.break_ ran with the switch on.
    for raw, overrides in (({}, ["lab.break_=no_rng_restore"]), ({"lab": {"break_": "no_rng_restore"}}, [])):
        with pytest.raises(BadInput, match=r"unknown config key 'lab\.break_'"):
            build(raw, "test", ["data.name=text", "model.name=gpt", *overrides], DATASETS, MODELS)
    assert build({}, "test", ["data.name=text", "model.name=gpt", "lab.break=no_rng_restore"], DATASETS,
                 MODELS).lab.break_ == "no_rng_restore"
