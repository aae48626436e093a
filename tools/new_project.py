"""Start a project of your own from this one: the loop, its tools and train.py, with a skeleton data
set and model in place of the examples.

    make new-project DEST=../myproj              # or: python -m tools.new_project ../myproj
    make new-project DEST=../myproj EXAMPLES=1   # the example data sets and models too

DEST gets loop/, tools/, bench/, docs/, train.py, the Makefile and the files that build and ship it
(pyproject.toml, requirements.lock, Dockerfile, .ci/, ...), and:
    data/mine.py, model/mine.py    a small regression task and an MLP (tools/skeleton/): replace them
    configs/default.yaml           the run `make train` makes: data.name=mine, model.name=mine
    tests/test_project.py          the loop's promises on the project's own default run
DEST's directory name names the project (pyproject.toml, the README, the Docker image, the SLURM job).
As made, it trains (`make train`), passes its tests (`make test-fast`, `make test`) and `make
verify`. With EXAMPLES=1 the scaffold's data sets and models (text, markov, random, tokens,
shakespeare, mnist; gpt, cnn) and their configs come too, registered beside mine. Exit codes: 0
made, 2 bad input (DEST exists and is not an empty directory, cannot be made or written, or is
inside this project).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import shutil
import sys
from pathlib import Path

from loop.errors import EXIT_BAD_INPUT, BadInput

ROOT = Path(__file__).resolve().parents[1]
SKELETON = Path(__file__).resolve().parent / "skeleton"
# What every project has: the loop, what runs and checks it, and how it is built and shipped.
COPIED = ["loop", "tools", "bench", "docs", "scripts/slurm.sbatch", ".ci", "train.py", "Makefile",
          "pyproject.toml", "requirements.lock", "Dockerfile", ".dockerignore", ".gitignore",
          ".env.example", "tests/test_project.py", "tests/test_jsonl.py", "tests/test_metrics.py"]
LEFT_OUT = ("__pycache__", "*.pyc", "results")  # bench/results: this project's measurements
# Where this project's name is said, as (before, after) it: the package, the image tag and the
# image that docker run starts, the SLURM job. Only there: a project named "train" or "test" has
# those words in train.py, the trainer user and the test extra too.
NAMED = {"pyproject.toml": [('^name = "', '"$')], "Dockerfile": [("-t ", r" \.$"), ('^#   docker run .*" ', r"\s")],
         "scripts/slurm.sbatch": [("^#SBATCH --job-name=", "$")]}
EXAMPLES = {"data": "DATASETS", "model": "MODELS"}  # package -> its registry
SCAFFOLD_ONLY = ROOT / "tests" / "test_copy.py"  # the scaffold's test of this tool: no project has it


def make(dest: Path, examples: bool) -> None:
    dest = dest.expanduser()  # make's DEST=~/x reaches here unexpanded
    if examples and not SCAFFOLD_ONLY.exists():  # a project's data/ and model/ hold its own modules
        raise BadInput("--examples: this is a project of your own, whose data/ and model/ hold no example; "
                       "make the new project from the scaffold (make new-project DEST=... EXAMPLES=1).")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"DEST={dest}: already exists and is not an empty directory; expected a new path.")
    if dest.resolve().is_relative_to(ROOT):  # its tests, or its copies, or its git commit taken for the project's
        raise BadInput(f"DEST={dest}: inside {ROOT}, the project it copies; expected a path outside it "
                       f"(e.g. ../{dest.name}).")
    made = [d for d in (dest, *dest.parents) if not d.exists()]  # DEST first, then its parents
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, a place no directory can be made
        raise BadInput(f"DEST={dest}: cannot be made ({e.strerror}); expected a path where a directory "
                       f"can be made.") from None
    try:
        copy(dest, examples)
    except BaseException as e:  # no half-made project left (a rerun would refuse it): DEST as it was
        if made:
            shutil.rmtree(dest, ignore_errors=True)
            for parent in made[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()
        else:  # it was empty
            for child in list(dest.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        why = e.strerror or e
        if isinstance(e, shutil.Error):  # copytree's, one entry per file: the first, and how many
            why = f"{e.args[0][0][2]}, and {len(e.args[0]) - 1} more" if len(e.args[0]) > 1 else e.args[0][0][2]
        raise BadInput(f"DEST={dest}: cannot write the project there ({why}); what was copied is removed. "
                       f"Expected a directory this user can write to, with room for the copy.") from None


def copy(dest: Path, examples: bool) -> None:
    """The project's files into the empty directory `dest`."""
    for name in COPIED:
        src, to = ROOT / name, dest / name
        to.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, to, ignore=shutil.ignore_patterns(*LEFT_OUT))
        else:
            shutil.copy2(src, to)
    shutil.copytree(SKELETON, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*LEFT_OUT))
    if examples:
        for package, registry in EXAMPLES.items():
            for module in (ROOT / package).glob("*.py"):
                if module.name != "__init__.py":
                    shutil.copy2(module, dest / package / module.name)
            mine = (dest / package / "__init__.py").read_text()
            (dest / package / "__init__.py").write_text(
                mine + f"\n# The scaffold's examples ({package}/*.py), beside yours.\n"
                f"from {package} import examples  # noqa: E402\n\n{registry}.update(examples.{registry})\n")
            theirs = (ROOT / package / "__init__.py").read_text()
            (dest / package / "examples.py").write_text(theirs)
        for config in (ROOT / "configs").glob("*.yaml"):
            name = "text.yaml" if config.name == "default.yaml" else config.name
            shutil.copy2(config, dest / "configs" / name)
    ours = re.search(r'^name = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    name = project_name(dest)
    for path, places in NAMED.items():
        text = (dest / path).read_text()
        for before, after in places:
            text = re.sub(f"({before}){re.escape(ours)}(?={after})", lambda m: m[1] + name, text, flags=re.M)
        (dest / path).write_text(text)
    (dest / "README.md").write_text(readme(name, examples))


def project_name(dest: Path) -> str:
    """DEST's directory name as a package name and an image tag: lowercase letters, digits and
    single dashes ("My Proj_2" -> "my-proj-2")."""
    return "-".join(re.findall(r"[a-z0-9]+", dest.resolve().name.lower())) or "my-project"


def readme(name: str, examples: bool) -> str:
    more = ("\nThe scaffold's examples are here too (data/examples.py, model/examples.py name them; "
            "configs/text.yaml is its default run): `python train.py --config configs/mnist.yaml`.\n"
            if examples else "")
    kept = "tests and measurements (`bench/results/`)" if examples else \
        "tests, measurements (`bench/results/`) and examples (`configs/mnist.yaml`, also in the Makefile's and " \
        "`tools/verify.py`'s examples)"
    return f"""# {name}

Made from the honest loop: a plain-PyTorch training loop whose every promise (exact resume,
accumulation, determinism, NaN and out-of-memory handling) is proved by a test.

    make train        # the default run: configs/default.yaml
    make test-fast    # the project's tests (make test: all of them)
    make verify       # the loop's promises, checked on your model and data

Yours: `data/mine.py` (the data set), `model/mine.py` (the model), `configs/default.yaml` (the run);
register more in `data/__init__.py` and `model/__init__.py`, and run another with its own
directory: `make train ARGS="model.name=X run.out_dir=runs/X"`. The loop is `loop/`, read from
`loop/trainer.py`; `docs/` says what each part does and promises, and names the scaffold's
{kept}, which stay in the scaffold's repository. Put the project under git (`git init`):
each run's metadata.json records the commit it ran.
{more}"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.new_project", description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="where the project is made (a new or empty directory)")
    p.add_argument("--examples", action="store_true", help="copy the example data sets and models too")
    a = p.parse_args(argv)
    try:
        make(a.dest, a.examples)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    dest = a.dest.expanduser()
    print(f"made {dest}: cd {shlex.quote(str(dest))} && make train")
    return 0


if __name__ == "__main__":
    sys.exit(main())
