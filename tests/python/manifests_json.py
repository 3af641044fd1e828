"""Prints the YAML documents of a file (e.g. `helm template` output) as one JSON list,
empty documents left out, for the Helm chart's test to inspect."""

import json
import sys

import yaml

with open(sys.argv[1], encoding="utf-8") as f:
    docs = [d for d in yaml.safe_load_all(f) if d is not None]
print(json.dumps(docs))
