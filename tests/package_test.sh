#!/usr/bin/env bash
# The .deb from `make package`: built with CPack from BUILD_DIR into a temporary directory,
# then checked with dpkg-deb (contents, dependencies, conffiles, maintainer script), its man
# pages read back, and its systemd unit checked by `systemd-analyze verify`.
# Exits 77 (skipped) when a tool is missing, 1 under CI=true (tests/support/skip.sh).
# Usage: package_test.sh BUILD_DIR
set -euo pipefail
build=$1
. "$(dirname "$0")/support/skip.sh"
require_program cpack cmake
require_program dpkg-deb dpkg
require_program dpkg-shlibdeps dpkg-dev
require_program systemd-analyze systemd
require_program help2man help2man
require_program zcat gzip
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
(cd "$build" && cpack -G DEB -B "$out" > "$out/cpack.log" 2>&1) || { cat "$out/cpack.log"; exit 1; }
deb=$(ls "$out"/*.deb)
fail() { echo "FAILED: $*"; exit 1; }
dpkg-deb -c "$deb" | awk '{print $NF}' > "$out/contents"
for f in ./usr/bin/mglaunch ./usr/bin/mglaunch-rdzv ./usr/bin/mglaunch-sbatch ./lib/systemd/system/mglaunch-rdzv.service \
         ./etc/mglaunch/rdzv.conf ./usr/share/man/man1/mglaunch.1.gz ./usr/share/man/man1/mglaunch-rdzv.1.gz \
         ./usr/share/doc/mglaunch/README.md ./usr/share/doc/mglaunch/docs/flags.md \
         ./usr/share/doc/mglaunch/docs/design.md ./usr/share/doc/mglaunch/docs/status_page.png \
         ./usr/share/mglaunch/python/mglaunch_recovery/__init__.py; do
  grep -qx "$f" "$out/contents" || fail "$f is not in the package"
done
dpkg-deb -f "$deb" Depends | grep -q libssl || fail "no libssl in Depends: $(dpkg-deb -f "$deb" Depends)"
dpkg-deb -e "$deb" "$out/control"
grep -qx /etc/mglaunch/rdzv.conf "$out/control/conffiles" || fail "rdzv.conf is not a conffile"
[ -x "$out/control/postinst" ] || fail "postinst is not executable"
sh -n "$out/control/postinst" || fail "postinst is not valid sh"
mkdir "$out/root"
dpkg-deb -x "$deb" "$out/root"
zcat "$out/root/usr/share/man/man1/mglaunch.1.gz" | grep -q 'nproc_per_node' || fail "mglaunch.1 lacks the flags"
zcat "$out/root/usr/share/man/man1/mglaunch-rdzv.1.gz" | grep -q 'max\\*\?-connections' || fail "mglaunch-rdzv.1 lacks the flags"
# Every page's NAME line says what the program is, not its name twice ("mglaunch \- mglaunch"),
# and mglaunch's page names its other forms (doctor, --hostfile).
for page in "$out"/root/usr/share/man/man1/*.1.gz; do
  name=$(basename "$page" .1.gz)
  zcat "$page" | sed -n '/^\.SH NAME/{n;p;}' | grep -Eqv "^${name} \\\\?- ${name}\$" ||
    fail "$name.1: NAME line is '$(zcat "$page" | sed -n '/^\.SH NAME/{n;p;}')'"
done
zcat "$out/root/usr/share/man/man1/mglaunch.1.gz" | grep -q 'doctor' || fail "mglaunch.1 does not mention doctor"
zcat "$out/root/usr/share/man/man1/mglaunch.1.gz" | grep -q 'hostfile' || fail "mglaunch.1 does not mention --hostfile"
# The unit as packaged, with ExecStart pointing at the unpacked binary (verify checks that
# the command exists; the package is not installed on this machine). Documentation= names a
# man page this machine does not have installed, hence --man=no.
sed "s|/usr/bin/mglaunch-rdzv|$out/root/usr/bin/mglaunch-rdzv|" "$out/root/lib/systemd/system/mglaunch-rdzv.service" \
  > "$out/mglaunch-rdzv.service"
grep -q "ExecStart=$out/root/usr/bin/mglaunch-rdzv" "$out/mglaunch-rdzv.service" || fail "unexpected ExecStart"
SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no "$out/mglaunch-rdzv.service" > "$out/verify.log" 2>&1 ||
  { cat "$out/verify.log"; fail "systemd-analyze verify"; }
if grep "mglaunch-rdzv.service" "$out/verify.log"; then fail "systemd-analyze verify warned about the unit"; fi
echo "1 passed, 0 failed"
