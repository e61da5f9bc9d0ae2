"""Help text more than one ``kiln`` command shares, so the flags read the same everywhere."""

TRUST_HELP = ("load native code (TorchInductor partitions) from an artifact that no key trusted here "
              "signed (as KILN_TRUST_NATIVE_CODE=1); only for artifacts from a source you trust")
