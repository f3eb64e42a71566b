"""The card's folders install under one import name, `raylane` (project metadata: pyproject.toml).

`cluster/` is the package itself (the face: CLI, client, launch, bench), and the lower layers are
its subpackages: `actors/` -> `raylane.actors`, `kernels/` -> `raylane.kernels`, ...
"""

from setuptools import find_packages, setup

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

setup(
    package_dir=package_dir,
    packages=packages,
    package_data={"raylane.kernels": ["attention/csrc/*.c", "csrc/*.c", "csrc/*.h"]},
)
