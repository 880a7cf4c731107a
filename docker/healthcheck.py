"""Container healthcheck: exit 0 when the URL (the planner's /readyz) answers 200 within 3 s."""
import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=3) as resp:
        sys.exit(0 if resp.status == 200 else 1)
except Exception:
    sys.exit(1)
