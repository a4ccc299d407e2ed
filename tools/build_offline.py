"""Build the book for reading without a server, and zip it: ``make docs-offline``.

    python tools/build_offline.py [--out DIR]   ->  DIR/site-offline/  and  DIR/site-offline.zip

The build is the hosted one with Material's ``offline`` plugin on (``OFFLINE=true``, see
mkdocs.yml): links point at ``.html`` files and the search index is a script, so the pages work
opened from ``file://`` (a workshop's USB stick, a downloaded copy). Unzip and open
``site-offline/index.html``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "site-offline"


def build_offline(out: Path) -> Path:
    """Build into ``out/site-offline/`` and zip it to ``out/site-offline.zip``; returns the zip."""
    site = out / NAME
    shutil.rmtree(site, ignore_errors=True)
    env = {**os.environ, "OFFLINE": "true", "NO_MKDOCS_2_WARNING": "1"}
    env.pop("SITE_URL", None)  # links stay relative: the copy works wherever it is unzipped
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"error: the offline build failed (mkdocs exit {proc.returncode}); "
                         "its messages are above")
    # 404.html is for a server to send; from file:// nothing does, and its links are absolute.
    (site / "404.html").unlink()
    archive = out / f"{NAME}.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(site.rglob("*")):
            zf.write(path, path.relative_to(out).as_posix())
    return archive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="where site-offline/ and the zip go")
    args = parser.parse_args()
    archive = build_offline(args.out.resolve())
    print(f"{archive} ({archive.stat().st_size / 1e6:.1f} MB): unzip it and open "
          f"{NAME}/index.html in a browser")


if __name__ == "__main__":
    main()
