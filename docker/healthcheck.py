"""Container healthcheck: exit 0 when PREFIX_ROUTER_HEALTH_URL answers 200 within 2 s.

httpx, the project's one HTTP client (a base dependency, so in the image); no proxy from
the environment and no redirect: the check is of this container's own port."""

import os
import sys

import httpx

url = os.environ.get("PREFIX_ROUTER_HEALTH_URL", "http://127.0.0.1:9190/metrics")
try:
    response = httpx.get(url, timeout=2, trust_env=False)
except httpx.HTTPError as error:
    print(f"unhealthy: {url}: {error}", file=sys.stderr)
    sys.exit(1)
sys.exit(0 if response.status_code == 200 else 1)
