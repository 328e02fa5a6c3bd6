#!/usr/bin/env bash
# Installs the system packages the test tiers need, only when they are missing:
#   promtool (Debian's `prometheus`) checks the exposition format of our metrics and the chart's alert
#   rules (tests/integration/test_chart_alerts.py);
#   openssl makes the local control plane's certificates.
set -euo pipefail

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
[ ${#missing[@]} -eq 0 ] && exit 0

echo ">>> installing system packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  sudo=sudo
  command -v sudo >/dev/null 2>&1 || {
    echo "error: need root (or sudo) to install ${missing[*]}; install them with your package manager" >&2
    exit 1
  }
else
  sudo=
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
