"""Init container of the ctxmem chart: the service config plus tenant tokens from a Secret.

usage: merge-tokens.py CONFIG TOKENS_DIR OUT

CONFIG is the chart's rendered config (no tokens), TOKENS_DIR the mounted Secret (one
file per tenant: the file name is the tenant, its content the token), OUT the config the
service reads, written 0600 into a memory emptyDir. Runs with the image's own Python and
PyYAML; the service checks the tokens (length, placeholders) when it starts.
"""

import os
import sys

import yaml


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, tokens_dir, out = argv[1:]
    with open(src, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    tokens = {}
    for name in sorted(os.listdir(tokens_dir)):
        path = os.path.join(tokens_dir, name)
        # A Secret volume also holds ..data and a timestamped directory: skip dot names.
        if name.startswith(".") or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            tokens[name] = f.read().strip()
    if not tokens:
        print(f"merge-tokens: no tenant tokens in {tokens_dir} (one key per tenant in the "
              f"Secret named by tenantTokens.existingSecret)", file=sys.stderr)
        return 1
    service = cfg.setdefault("service", {})
    service.pop("insecure", None)
    service["tenant_tokens"] = tokens
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    print(f"merge-tokens: {len(tokens)} tenant token(s) merged into {out}: "
          f"{', '.join(tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
