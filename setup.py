"""Ships ``remat_dist_torch_remat.pth`` into site-packages beside the package.

Everything else is in pyproject.toml. The ``.pth`` line does nothing unless
``REMAT_DIST_AS_TORCH_REMAT`` is set (remat_dist/_torch_remat_env.py, docs/torchtitan.md).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "remat_dist_torch_remat.pth"


class BuildPyWithPth(build_py):
    """build_py, plus the ``.pth`` at the root of the built tree (site-packages)."""

    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [
            *super().get_outputs(include_bytecode),
            os.path.join(self.build_lib, PTH),
        ]


setup(cmdclass={"build_py": BuildPyWithPth})
