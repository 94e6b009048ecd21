"""Entry point for `pulumi up --stack <name>`: the program itself lives in infra/program.py."""

import sys
from pathlib import Path

import pulumi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: infra/, trainer/, serving/

from infra.program import run

for key, value in run().items():
    pulumi.export(key, value)
