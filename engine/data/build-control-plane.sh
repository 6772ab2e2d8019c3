#!/bin/bash
# Build the control-plane binaries the lab and the integration tests run: kube-apiserver,
# kube-controller-manager, kube-scheduler v1.20.2 from Debian bookworm's "kubernetes" source package
# with Debian's Go 1.19, plus Debian's etcd 3.4, into one folder laid out like envtest's
# KUBEBUILDER_ASSETS.
#
#   output  ${RUNBOOK_ASSETS:-~/.cache/runbook/k8s-v1.20.2}   (never inside the repository)
#   work    ${RUNBOOK_BUILD_DIR:-~/.cache/runbook/build}      (~2.5 GB during the build)
#
# Skips everything when KUBEBUILDER_ASSETS or the output folder already holds all four binaries.
# Nothing is installed system-wide: .debs are unpacked with dpkg -x, and EVERY download (binary
# and source) comes from a private apt source list pinned to bookworm (the machine's own apt
# configuration is never used to resolve packages, so Debian 13 machines work too). The archive
# URI is the one the machine's apt already uses; RUNBOOK_DEBIAN_MIRROR overrides it (needed on
# Ubuntu, whose archive has no bookworm). ~6 min cold on 2 cores.
set -euo pipefail

OUT=${RUNBOOK_ASSETS:-$HOME/.cache/runbook/k8s-v1.20.2}
W=${RUNBOOK_BUILD_DIR:-$HOME/.cache/runbook/build}
BINARIES="etcd kube-apiserver kube-controller-manager kube-scheduler"
WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler"
T0=$(date +%s)

say() { printf '[build-control-plane %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

complete() {  # complete DIR: all four binaries present, non-empty and executable
  local b
  [ -n "${1:-}" ] || return 1
  for b in $BINARIES; do [ -s "$1/$b" ] && [ -x "$1/$b" ] || return 1; done
}

if complete "${KUBEBUILDER_ASSETS:-}"; then
  say "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS holds all four binaries: nothing to build"; exit 0
fi
if complete "$OUT"; then say "cached: $OUT holds all four binaries: nothing to build"; exit 0; fi

mkdir -p "$W" "$OUT"
exec 9>"$W/.lock"
if ! flock -n 9; then say "another build holds $W/.lock: waiting for it"; flock 9; fi
if complete "$OUT"; then say "built meanwhile by another process: $OUT"; exit 0; fi

for tool in apt-get dpkg make tar; do
  command -v "$tool" >/dev/null || { say "missing $tool (this script needs a Debian-like machine)"; exit 2; }
done
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$KEYRING" ] || { say "missing $KEYRING (apt-get install debian-archive-keyring)"; exit 2; }

# 1. a private apt list pinned to bookworm (binary and source); system apt configuration untouched
mkdir -p "$W"/debs "$W"/root "$W"/src "$W"/wrapbin "$W"/home "$W"/apt/lists/partial "$W"/apt/archives/partial
MIRROR=${RUNBOOK_DEBIAN_MIRROR:-}
if [ -z "$MIRROR" ]; then
  MIRROR=$(apt-get indextargets --format '$(REPO_URI)' 2>/dev/null | grep -vi -- -security | grep -i debian \
           | sort -u | head -n 1 || true)
fi
if [ -z "$MIRROR" ]; then
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  elif [ -r /etc/apt/sources.list ]; then
    MIRROR=$(awk '$1=="deb" && $0 !~ /security/ {for(i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
             /etc/apt/sources.list)
  fi
fi
[ -n "$MIRROR" ] || { say "no Debian archive found in this machine's apt configuration: set RUNBOOK_DEBIAN_MIRROR"; exit 2; }
MIRROR=${MIRROR%/}/
: > "$W"/apt/status   # an empty dpkg status: the machine's installed versions never become the candidates
printf 'deb [signed-by=%s] %s bookworm main\ndeb-src [signed-by=%s] %s bookworm main\n' \
  "$KEYRING" "$MIRROR" "$KEYRING" "$MIRROR" > "$W"/apt/src.list
APTO=(-o "Dir::Etc::SourceList=$W/apt/src.list" -o Dir::Etc::SourceParts=/dev/null
      -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
      -o "Dir::State::Lists=$W/apt/lists" -o "Dir::State::status=$W/apt/status"
      -o "Dir::Cache::Archives=$W/apt/archives"
      -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o APT::Default-Release=bookworm)
quiet_apt() { grep -v -e unsandboxed -e '^Get:' -e '^Hit:' -e '^Ign:' || true; }

say "1/5 private apt lists for bookworm from $MIRROR"
apt-get "${APTO[@]}" update -q 2>&1 | quiet_apt

# 2. Go 1.19 toolchain, rsync (the k8s build needs it), etcd, newer reflect2/json-iterator (.debs, unpacked)
say "2/5 downloading Go 1.19, rsync, etcd and Go libraries as .debs (unpacked into $W/root)"
cd "$W"/debs
if ! ls golang-1.19-go_*.deb etcd-server_*.deb >/dev/null 2>&1; then
  apt-get "${APTO[@]}" download -q golang-1.19-go golang-1.19-src rsync libpopt0 etcd-server \
    golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev 2>&1 | quiet_apt
fi
for f in *.deb; do dpkg -x "$f" "$W"/root; done
MULTIARCH=$(cd "$W"/root/usr/lib && ls -d ./*-linux-gnu* 2>/dev/null | head -n 1)
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$W/root/usr/lib/${MULTIARCH#./}" \
  "$W/root/usr/bin/rsync" > "$W"/wrapbin/rsync
chmod +x "$W"/wrapbin/rsync

say "3/5 kubernetes 1.20.2 source (Debian's package)"
cd "$W"/src
if [ ! -d kubernetes-1.20.2/vendor ]; then
  rm -rf kubernetes-1.20.2
  ls kubernetes_*.orig.tar.gz >/dev/null 2>&1 || \
    apt-get "${APTO[@]}" source --download-only kubernetes 2>&1 | quiet_apt
  tar xzf kubernetes_*.orig.tar.gz
  # Go >= 1.18: vendored reflect2 1.0.1 segfaults at run time -> Debian's reflect2 1.0.2 / json-iterator 1.1.12
  rm -rf kubernetes-1.20.2/vendor/github.com/modern-go/reflect2 kubernetes-1.20.2/vendor/github.com/json-iterator/go
  cp -r "$W"/root/usr/share/gocode/src/github.com/modern-go/reflect2 kubernetes-1.20.2/vendor/github.com/modern-go/
  cp -r "$W"/root/usr/share/gocode/src/github.com/json-iterator/go kubernetes-1.20.2/vendor/github.com/json-iterator/
fi
cd kubernetes-1.20.2
# a failed half-build leaves 0-byte tools in _output/bin that break the next make: start that folder anew
if [ -d _output/bin ] && [ -n "$(find _output/bin -maxdepth 1 -type f -size 0 -print -quit)" ]; then
  say "removing _output/bin (0-byte leftovers of an interrupted build)"; rm -rf _output/bin
fi

# 3. one make for all targets (code generators run once); progress every 30 s while Go is silent
say "4/5 make WHAT=\"$WHAT\" (about 6 minutes on 2 cores)"
export GOROOT="$W"/root/usr/lib/go-1.19 CGO_ENABLED=0 HOME="$W"/home
export PATH="$W"/wrapbin:"$GOROOT"/bin:$PATH
unset GOPATH GOFLAGS GOCACHE GOPROXY
( while sleep 30; do say "   still building ($(du -sh _output 2>/dev/null | cut -f1) in _output)"; done ) &
TICKER=$!
trap 'kill "$TICKER" 2>/dev/null || true' EXIT
make WHAT="$WHAT" 2>&1 | sed -u 's/^/    /'
kill "$TICKER" 2>/dev/null || true

say "5/5 installing binaries into $OUT"
for b in $WHAT; do
  n=$(basename "$b"); [ -s _output/bin/"$n" ] || { say "make produced no $n"; exit 1; }
  cp _output/bin/"$n" "$OUT/.$n.tmp" && mv -f "$OUT/.$n.tmp" "$OUT/$n"
done
cp "$W"/root/usr/bin/etcd "$OUT/.etcd.tmp" && mv -f "$OUT/.etcd.tmp" "$OUT/etcd"
chmod 755 "$OUT"/etcd "$OUT"/kube-*
[ "${KEEP_GO_CACHE:-0}" = 1 ] || rm -rf _output/local/go/cache   # ~1.5-2 GB Go build cache
for b in "$OUT"/kube-*; do say "$(basename "$b"): $("$b" --version 2>&1)"; done
say "etcd: $("$OUT"/etcd --version 2>&1 | head -n 1)"
complete "$OUT" || { say "incomplete output in $OUT"; exit 1; }
say "done: $OUT"
