#!/bin/sh
# Installs the gpufeed-jpeg wheel that the jpeg-wheel stage built (mounted at $1) into
# /opt/venv, with the libjpeg-turbo runtime package it was linked against (its name, which
# differs between Debian 12 and Ubuntu 24.04, was recorded beside the wheel), then imports it.
set -eu
dir=$1
apt-get update
# shellcheck disable=SC2046 # one package name per line
apt-get install -y --no-install-recommends $(cat "$dir/runtime-packages.txt")
rm -rf /var/lib/apt/lists/*
/opt/venv/bin/pip install --disable-pip-version-check --no-cache-dir --no-deps "$dir"/gpufeed_jpeg-*.whl
/opt/venv/bin/python -c 'import gpufeed_jpeg as g; print("gpufeed-jpeg: libjpeg-turbo", g.LIBJPEG_TURBO_VERSION)'
