"""The skip policy of tests/support/skip.h for Python tests: skip_test() prints one line
"skipped: REASON" and exits 77 (ctest: Skipped); require_*() accept what `make setup`
installs, and a missing one skips, or fails (exit 1, one line naming the Debian package)
under CI=true. MGTEST_MISSING=name,name... treats those programs as absent."""
import os
import shutil
import sys


def in_ci():
    return os.environ.get("CI", "") in ("true", "TRUE", "True", "1", "yes")


def skip_test(reason):
    print(f"skipped: {reason}", flush=True)
    sys.exit(77)


def require_installed(present, what, package):
    if present:
        return
    if in_ci():
        print(f"error: {what} is missing and CI=true: install Debian package {package} "
              "(make setup installs it; under CI a missing component fails, it does not skip)", flush=True)
        sys.exit(1)
    skip_test(f"{what} is missing (make setup installs Debian package {package})")


def require_program(name, package):
    """The program's path (absolute, or found on PATH), or a skip/failure."""
    missing = os.path.basename(name) in os.environ.get("MGTEST_MISSING", "").split(",")
    found = None if missing else (name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name))
    require_installed(found is not None, name, package)
    return found
