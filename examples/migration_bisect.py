"""Bisection down to the rewrite site, shown on a deliberately wrong rewrite
(docs/guide/migration.md): fuse_conv_act is replaced by a copy that writes a wrong bias
(+0.5) into the convolutions of the modules named on the command line (default: c2),
then ``opencann compare examples/migration_cnn.py:net --bisect`` runs.

    python examples/migration_bisect.py [MODULE ...]

The bug is injected for the demonstration only: nothing here is part of opencann."""
import sys

import opencann.engine.pipeline as compiler
from opencann import cli
from opencann.passes import FuseConvAct, default_pipeline


class WrongBiasConvAct(FuseConvAct):
    """fuse_conv_act (same name) with a wrong bias at the convolutions of ``bad``."""

    def __init__(self, bad):
        self.bad = tuple(bad)

    def rewrite(self, graph, m, ctx):
        if m.conv.scope in self.bad:
            b = m.conv.arg("bias")
            m.conv.replace_input(b, graph.add_const(b.const + 0.5, "bad_bias"))
        return super().rewrite(graph, m, ctx)


def main(bad) -> int:
    """Run ``opencann compare ... --bisect`` with the wrong rewrite at modules ``bad``."""
    def pipeline():
        p = default_pipeline()
        p.passes[p.names().index("fuse_conv_act")] = WrongBiasConvAct(bad)
        return p
    compiler.default_pipeline = pipeline
    return cli.main(["compare", "examples/migration_cnn.py:net", "--bisect", "--rows", "4"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["c2"]))
