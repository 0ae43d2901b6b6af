"""An older commit of hf_specdec imported beside this checkout's, for before/after runs in one process."""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_old(rev: str, into: Path):
    """hf_specdec at ``rev`` as the module ``hf_specdec_old``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "hf_specdec"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / "hf_specdec_old"
    (into / "hf_specdec").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bhf_specdec\b", "hf_specdec_old", path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("hf_specdec_old")
