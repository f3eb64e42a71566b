"""The card's folders install under one import name, `raylane` (project metadata: pyproject.toml).

`cluster/` is the package itself (the face: CLI, client, launch, the four `raylane bench`
benchmarks), and the lower layers are its subpackages: `actors/` -> `raylane.actors`,
`kernels/` -> `raylane.kernels`, ... Nothing else installs: the developers' benchmarks
(benchmarks/) and the tests with their fakes (tests/) run from a checkout.
"""

import atexit
import shutil
import tempfile

from setuptools import find_packages, setup
from setuptools.command.build import build

FOLDERS = {
    "cluster": "raylane",
    "actors": "raylane.actors",
    "kernels": "raylane.kernels",
    "router": "raylane.router",
    "session_server": "raylane.session_server",
}

package_dir = {name: folder for folder, name in FOLDERS.items()}
packages = [
    f"{name}.{sub}" if sub else name
    for folder, name in FOLDERS.items()
    for sub in ["", *find_packages(folder)]
]


class FreshBuild(build):
    """Builds in a fresh temp dir, not the checkout's build/: pip builds a wheel in the source
    tree, and a module moved or deleted since an earlier build would stay in build/lib and ship."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.build_base = tempfile.mkdtemp(prefix="raylane-build-")
        atexit.register(shutil.rmtree, self.build_base, True)


setup(
    package_dir=package_dir,
    packages=packages,
    package_data={"raylane.kernels": ["attention/csrc/*.c", "csrc/*.c", "csrc/*.h"]},
    cmdclass={"build": FreshBuild},
)
