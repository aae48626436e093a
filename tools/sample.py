"""Text from a trained model: a run's exported model.pt, or any checkpoint, continued from a prompt.

    python -m tools.sample runs/default                        # the finished run's model.pt
    python -m tools.sample runs/default --prompt "def " --tokens 300 --temperature 0.5 --seed 1
    python -m tools.sample runs/default/checkpoints/latest     # a run still training (or stopped)
    python -m tools.sample runs/default --ema                  # its EMA weights (ema.enabled runs)

The model is rebuilt from the config saved with the weights, and the vocabulary comes from its data
set, as training built it (data.cache_dir, re-prepared from data.path if the cache is gone): run it
from where the training ran, relative paths are read from there. On the CPU unless --device says
otherwise. The same seed gives the same text. A character-level corpus takes the prompt as text; a
token file takes it as token ids ("1 2 3") and prints ids. An empty prompt starts from token 0 (a
newline in most texts). Bad input (no such file, a prompt outside the vocabulary, a model that does
not generate or whose weights diverged, a corpus edited since training) is exit 2 with a message
that names it.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
from pathlib import Path

import torch

from data import DATASETS
from loop.build import build_data, build_model
from loop.checkpoint import resume, store, weights
from loop.config.arguments import at_least, positive
from loop.config.load import build
from loop.device import pick_device
from loop.errors import EXIT_BAD_INPUT, EXIT_CONSOLE_GONE, EXIT_INTERRUPTED, BadInput
from loop.guards.console import console_gone, mute_dead_console
from model import MODELS

CODE = "Use the model code it was trained with."  # the config is its own: only the code can differ


def load(path: Path, ema: bool, device: torch.device):
    """(model in eval mode, its data) from a run dir, a model.pt or a checkpoint dir."""
    path = resume.followed(path)
    if path.name == "state.pt" and path.is_file():  # a checkpoint's: its directory
        path = path.parent
    if (path / "model.pt").is_file():
        trained_on(path)
        path = path / "model.pt"
    if path.is_file():
        saved = store.load(path.parent, path.name)
    elif path.is_dir() and ((path / store.MANIFEST).exists() or path.name.startswith("step_")):
        saved = store.load(resume.verified(path, "checkpoint"), "state.pt")
    else:
        raise BadInput(f"{path}: expected a run directory with model.pt, a model.pt, or a checkpoint "
                       f"directory.{resume.checkpoints_near(path)}")
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise BadInput(f"{path}: no config saved with these weights (a bare state_dict?); expected a "
                       f"model.pt or checkpoint that train.py wrote.")
    cfg = build(saved["config"], str(path), [], DATASETS, MODELS)
    data = build_data(cfg.data, DATASETS)
    if path.is_file() and "data" not in saved:  # a model.pt exported before it held its "data"
        saved["data"] = (_json(path.parent / "metadata.json") or {}).get("data")
    check_corpus(data, saved["data"] if path.is_file() else (saved.get("metadata") or {}).get("data"), path)
    model = build_model(cfg.model, data, MODELS)
    if not hasattr(model, "generate") or data.decode is None:
        raise BadInput(f"{path}: model.name={cfg.model.name} on data.name={cfg.data.name} does not "
                       f"generate text (no generate method, or data without a decoder).")
    if path.is_file():
        if ema and saved.get("ema") is None:
            raise BadInput(f"{path}: --ema, but it holds no EMA weights (ema.enabled was off).")
        state = saved["ema" if ema else "model"]
        weights.refuse_mismatch(model, state, f"model file {path}", saved["config"], cfg, CODE)
        weights.load_whole(model, state)
    elif ema:
        raise BadInput(f"{path}: --ema reads a finished run's model.pt; a checkpoint's is not loaded here.")
    else:
        weights.load_model_state(path, model, cfg, advice=CODE)
    return model.to(device).eval(), data


def trained_on(run: Path) -> None:
    """A finished run resumed for more steps (or resuming now): its model.pt is from its first end.
    Said, with where the newest weights are; model.pt is what is sampled, as asked."""
    steps, latest = (_json(run / "summary.json") or {}).get("steps"), run / "checkpoints" / "latest"
    name = latest.read_text(errors="replace").strip() if latest.is_file() else ""
    if isinstance(steps, int) and (m := store.STEP_DIR.match(name)) and int(m.group(1)) > steps:
        print(f"note: {run / 'model.pt'} holds step {steps}'s weights; the run has trained on since, "
              f"to {name}: for those, give {latest}", file=sys.stderr)


def _json(path: Path) -> dict | None:
    try:  # a model.pt copied away from its run has no metadata.json beside it: nothing to check
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_corpus(data, recorded: dict | None, path: Path) -> None:
    """A text corpus's characters are its vocabulary: edited since training (the cache is keyed by
    content, so it is prepared anew), it may list them in another order, and the text came out
    decoded with the wrong characters without a word. Compared by the sha256 the run recorded."""
    was, now = (recorded or {}).get("sha256"), data.meta.get("sha256")
    if data.meta.get("kind") == "chars" and was and was != now:
        raise BadInput(f"{path}: trained on a corpus with sha256 {was[:16]}..., but data.path "
                       f"({data.meta.get('source')}) now holds {now[:16]}...: its characters, the "
                       f"model's vocabulary, may differ, and the text would be decoded wrongly; "
                       f"expected the text it was trained on there.")


def encode(prompt: str, data) -> list[int]:
    """The prompt's token ids: characters of a character-level corpus, else ids written out."""
    if data.meta.get("kind") == "chars":  # as the data set decodes (data/tokens.py)
        lut = {c: i for i, c in enumerate(data.meta["chars"])}
        if missing := sorted(set(prompt) - lut.keys()):
            raise BadInput(f"option --prompt: {''.join(missing)!r} not in the model's vocabulary "
                           f"(the {len(lut)} characters of its training text).")
        return [lut[c] for c in prompt] or [0]
    try:
        ids = [int(t) for t in prompt.split()] or [0]
    except ValueError:
        raise BadInput(f"option --prompt: {prompt!r}; this model reads token ids, expected integers "
                       f"separated by spaces.") from None
    if bad := [i for i in ids if not 0 <= i < data.vocab_size]:
        raise BadInput(f"option --prompt: token ids {bad} outside the vocabulary (0 to {data.vocab_size - 1}).")
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.sample", description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path, help="a run dir, a model.pt or a checkpoint dir")
    p.add_argument("--prompt", default="", help="text (or token ids) to continue; default: token 0")
    p.add_argument("--tokens", type=at_least(1), default=200, help="tokens to generate (200), printed as they come")
    p.add_argument("--temperature", type=positive, default=None,
                   help="> 0: lower draws the likelier tokens more often (default: the model's "
                        "generate() default, 0.8 for the GPT)")
    p.add_argument("--seed", type=at_least(0, 2**64 - 1), default=0)  # what a torch.Generator takes
    p.add_argument("--ema", action="store_true", help="the EMA weights of model.pt")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto")
    a = p.parse_args(argv)
    try:
        device = pick_device(a.device, "option --device")
        with contextlib.redirect_stdout(sys.stderr):  # "preparing ...": stdout is the text alone
            model, data = load(a.path, a.ema, device)
        prompt = torch.tensor([encode(a.prompt, data)], device=device)  # (1, T)
        g = torch.Generator(device).manual_seed(a.seed)
        # The loop's own sample calls generate(prompt, n, generator): a model of yours need not
        # take a temperature, and then only this option asks for one.
        options = {} if a.temperature is None else {"temperature": a.temperature}
        if options and "temperature" not in inspect.signature(model.generate).parameters:
            raise BadInput(f"option --temperature: this model's generate() ({type(model).__name__}) "
                           f"takes no temperature; leave the option out.")
        try:
            stream(model, prompt, a.tokens, g, options, data.decode)
        except RuntimeError as e:  # torch.multinomial's refusal of inf or NaN probabilities
            if "probability tensor contains" not in str(e):
                raise
            raise BadInput(f"{a.path}: the model's next-token probabilities are not finite, so no token "
                           f"can be drawn: its weights diverged (see val_loss in the run's "
                           f"summary.json); expected a model that trained, e.g. an earlier "
                           f"checkpoint.") from None
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # a long text stopped by hand: what was printed is the text so far
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `| head`: the reader has what it wanted, and a traceback helps no one
        if not console_gone():
            raise
        mute_dead_console()  # the interpreter's last flush of stdout too
        return EXIT_CONSOLE_GONE
    return 0


@torch.no_grad()
def stream(model, ids: torch.Tensor, n: int, g: torch.Generator, options: dict, decode, chunk: int = 64) -> None:
    """`n` tokens after `ids` (1, T), printed as they come, `chunk` at a time: a long text shows its
    progress and can be stopped. One generator drawn in order, so the text is the one a single
    generate(ids, n, g) call gives."""
    shown = ""
    while True:
        text = decode(ids[0].tolist())
        print(text[len(shown):], end="" if n else "\n", flush=True)
        shown = text
        if not n:
            return
        ids = model.generate(ids, min(chunk, n), g, **options)
        n -= min(chunk, n)


if __name__ == "__main__":
    sys.exit(main())
