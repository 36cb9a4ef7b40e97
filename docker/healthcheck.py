"""Container healthcheck: exit 0 when PREFIX_ROUTER_HEALTH_URL answers 200 within 2 s."""

import os
import sys
import urllib.request

url = os.environ.get("PREFIX_ROUTER_HEALTH_URL", "http://127.0.0.1:9190/metrics")
try:
    with urllib.request.urlopen(url, timeout=2) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as error:
    print(f"unhealthy: {url}: {error}", file=sys.stderr)
    sys.exit(1)
