"""Print the newest CPU build of torch ("+cpu" wheel) that pip can see here, or nothing.

ci/setup.sh installs it before the test extras, so Stable-Baselines3 does not pull
PyPI's CUDA build (~3 GB of wheels). Looks in pip's find-links directories (its
configuration and $PIP_FIND_LINKS) for a wheel this interpreter can install.
"""

import glob
import os
import subprocess
import sys

from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename


def find_links() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += value.strip().strip("'\"").split()
    return links


def main() -> None:
    tags, best = set(sys_tags()), None
    for link in find_links():
        for wheel in glob.glob(os.path.join(link.removeprefix("file://"), "torch-*+cpu-*.whl")):
            _, version, _, wheel_tags = parse_wheel_filename(os.path.basename(wheel))
            if tags & set(wheel_tags) and (best is None or version > best[0]):
                best = (version, wheel)
    print(best[1] if best else "")


if __name__ == "__main__":
    main()
