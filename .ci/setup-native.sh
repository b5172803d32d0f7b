#!/bin/sh
# What the host test environment needs to build gpufeed's native JPEG decoder (app/native,
# built by `make venv`): a C++ compiler and libjpeg-turbo's headers (Debian's libjpeg-dev).
# The Spark integration's tests (tests/unit/integrations/test_spark_dask.py) need a Java
# runtime for pyspark's JVM (Debian's default-jre-headless when none is on the machine).
# Idempotent: installs only what is missing.
set -eu

if ! command -v g++ >/dev/null 2>&1 || ! [ -f /usr/include/jpeglib.h ]; then
    printf '[setup-native] installing g++ and libjpeg-dev from Debian\n' >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        g++ libjpeg-dev >/dev/null
fi

if ! command -v java >/dev/null 2>&1; then
    printf '[setup-native] installing a Java runtime for pyspark from Debian\n' >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        default-jre-headless >/dev/null
fi
