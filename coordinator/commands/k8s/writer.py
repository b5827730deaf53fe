"""Writing a render: ``DIR/manifests/{file}.yaml`` and the ``DIR/kustomization.yaml`` that lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from coordinator.commands.k8s.objects import Manifest

__all__ = ["dump", "write"]


class _Dumper(yaml.SafeDumper):
    """Plain YAML: a label map used twice is written twice, not as an anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(objects: list[Manifest]) -> str:
    """The objects as one multi-document YAML text."""
    return "---\n".join(yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120) for obj in objects)


def write(files: dict[str, list[Manifest]], directory: Path, namespace: str | None = None) -> list[Path]:
    """Write ``directory/manifests/{file}.yaml`` and ``directory/kustomization.yaml``; return the paths."""
    manifests = directory / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    written = []
    for name, objects in files.items():
        path = manifests / f"{name}.yaml"
        path.write_text(dump(objects))
        written.append(path)
    kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    if namespace is not None:
        kustomization["namespace"] = namespace
    kustomization["resources"] = [f"manifests/{name}.yaml" for name in files]
    path = directory / "kustomization.yaml"
    path.write_text(
        "# Rendered by `cellmesh k8s render`: kubectl apply -k .\n"
        + yaml.safe_dump(kustomization, sort_keys=False)
    )
    return [*written, path]
