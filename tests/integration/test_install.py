"""The README's install lines resolve on a fresh machine: constraints.txt is a consistent lock.

A bare ``boto3`` beside ``s3fs`` in the test extra sent pip's resolver into 10+ minutes of
backtracking or ``ResolutionImpossible`` on four fresh machines out of five (aiobotocore pins
botocore to a narrow range, the newest boto3 pins another). The fix is a tested resolution,
``constraints.txt``, passed with every install; these checks keep it complete and consistent
without touching the network (the pins' own requirements are read from the installed metadata).
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCKED_EXTRAS = ("test", "integration")


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt pins exact versions: {line!r}"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in LOCKED_EXTRAS:
        reqs += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def test_every_requirement_of_the_locked_extras_is_pinned_within_its_range():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            continue  # pinned by the install command itself (the CPU wheel)
        assert name in pins, f"{req} is not in constraints.txt: rerun bash .ci/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt pins {name}=={pins[name]}, " \
                                                                      f"outside {req}"


def test_the_pins_satisfy_each_others_requirements():
    """What made the resolver backtrack: a pinned package requiring another pin's version
    outside its range (aiobotocore's botocore range against boto3's)."""
    pins, checked = _pins(), 0
    for name, version in pins.items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if Version(dist.version) != version:
            continue  # another version installed here: its metadata says nothing of the pin
        for line in dist.requires or []:
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            if dep not in pins or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            checked += 1
            assert req.specifier.contains(pins[dep], prereleases=True), \
                f"{name}=={version} requires {req}, constraints.txt pins {dep}=={pins[dep]}"
    if checked == 0:
        pytest.skip("none of the pinned versions is installed here")
    assert checked > 20  # the guard: the check really compared pins


def test_no_bare_boto3_beside_s3fs_in_an_extra():
    for extra, reqs in PROJECT["optional-dependencies"].items():
        names = {canonicalize_name(Requirement(r).name) for r in reqs}
        assert not {"s3fs", "boto3"} <= names, f"extra {extra!r} names boto3 beside s3fs"


def test_readme_and_ci_install_under_the_constraints():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
    installs = [line for line in first_block.splitlines() if "pip install" in line]
    assert len(installs) == 2 and all("-c constraints.txt" in line for line in installs)
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.count("-c constraints.txt") >= 2 and "taking longer than usual" in ci
