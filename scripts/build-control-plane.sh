#!/bin/bash
# Build (or reuse) the control-plane binaries for the lab and the integration tests.
# Thin wrapper: the script itself ships inside the package (engine/data/build-control-plane.sh)
# so that `engine.lab.assets.ensure_assets()` finds it in an installed copy too.
exec bash "$(dirname "$(readlink -f "$0")")/../engine/data/build-control-plane.sh" "$@"
