"""Output safety of an ingest: the checks on ``--out`` and ``--write_schema``, the staging
folder beside it (stale ones of killed runs removed), ``write_manifest`` (shards renamed,
``manifest.json`` written last) and ``publish`` (the finished dataset renamed into place)."""

from __future__ import annotations

import json
import os
import shutil

from array_record.python import array_record_module

from data import records, shards
from kunlun.utils import outputs


def check_paths(out_dir: str, write_schema: str | None, sources: dict,
                spec_file: str | None = None) -> None:
  """``--out`` and ``--write_schema`` by the rules every program's outputs follow
  (``kunlun.utils.outputs``): neither is an input (a log, the ``--schema`` file ``spec_file``)
  nor lies inside one, ``--out`` contains none, ``--write_schema`` is a regular file or a new
  path outside ``--out``; ``--out`` is a directory or a new path (a link to one is written
  through). A one-line ValueError otherwise."""
  inputs = [(f"--{split or 'input'}", s.path) for split, srcs in sources.items() for s in srcs]
  why = outputs.problem([("--write_schema", write_schema)], dirs=[("--out", out_dir, ("*",))],
                        inputs=inputs + [("--schema", spec_file)])
  if why:
    raise ValueError(why)


def check_out(out_dir: str, sources: dict, overwrite: bool, yes: bool, write_schema) -> None:
  """``check_paths``; an existing non-empty ``--out`` is replaced only with ``--overwrite`` and
  only when it is a dataset: its ``manifest.json`` has this format and lists every file in it
  (``dataset_files``). ``out_dir``: resolved (no links)."""
  check_paths(out_dir, write_schema, sources)
  if os.path.exists(out_dir) and os.listdir(out_dir) and (yes or not write_schema):
    if not overwrite:
      raise ValueError(f"--out={out_dir} exists and is not empty; pass --overwrite to replace a "
                       "dataset written before")
    dataset_files(out_dir)


def dataset_files(out_dir: str) -> set[str]:
  """The files (relative paths) of the dataset in ``out_dir``: those its ``manifest.json`` (of
  ``records.FORMAT``) lists, with ``schema.json``, ``manifest.json`` and ``ingest.json``. A
  ValueError when there is no such manifest or ``out_dir`` holds anything else: ``--overwrite``
  never removes what is not the dataset's."""
  not_ds = f"--out={out_dir} exists and is not empty (and is not a kunlun dataset: not removed)"
  try:
    with open(os.path.join(out_dir, "manifest.json")) as f:
      m = json.load(f)
  except (OSError, ValueError):
    raise ValueError(not_ds) from None
  if not isinstance(m, dict) or m.get("format") != records.FORMAT or not isinstance(
      m.get("splits"), dict):
    raise ValueError(not_ds + f": its manifest.json is not of format {records.FORMAT}")
  listed = {"manifest.json", "schema.json", "ingest.json"}
  try:
    for surfaces in m["splits"].values():
      for entries in surfaces.values():
        for e in entries:
          rel = os.path.normpath(e["file"])
          if os.path.isabs(rel) or rel.split(os.sep)[0] == "..":
            raise ValueError(f"{not_ds}: its manifest lists {e['file']!r}, outside it")
          listed.add(rel)
  except (AttributeError, KeyError, TypeError):
    raise ValueError(not_ds + ": malformed manifest.json") from None
  for root, dirs, files in os.walk(out_dir):
    for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
      rel = os.path.relpath(os.path.join(root, name), out_dir)
      if rel not in listed:
        raise ValueError(f"--out={out_dir} holds {rel}, which its manifest.json does not list: "
                         "not removed (move it away, or remove it yourself)")
  return listed


def staging_dir(out_dir: str) -> str:
  """Where the dataset is written before it is renamed to ``out_dir`` (same filesystem)."""
  parent, base = os.path.split(os.path.abspath(out_dir))
  return os.path.join(parent, f".{base}.ingest-{os.getpid()}")


def clear_stale(out_dir: str, warn=None) -> None:
  """Removes the staging folders (``staging_dir``) that killed runs left beside ``out_dir``:
  those whose process is gone."""
  parent, base = os.path.split(os.path.abspath(out_dir))
  prefix = f".{base}.ingest-"
  for name in os.listdir(parent) if os.path.isdir(parent) else ():
    pid = name[len(prefix):].split(".")[0]
    if not name.startswith(prefix) or not pid.isdigit():
      continue
    try:
      os.kill(int(pid), 0)
      continue                              # still running (another ingest): leave it
    except ProcessLookupError:
      pass
    except PermissionError:
      continue
    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    if warn:
      warn(f"removed {os.path.join(parent, name)}, left by an ingest that was killed")


def publish(tmp: str, out_dir: str) -> None:
  """Makes the finished dataset in ``tmp`` appear at ``out_dir`` (resolved: no links) by
  renames: a killed run leaves the previous dataset (or nothing), never a partial one. Of the
  previous dataset only the files its manifest lists are removed (``dataset_files``)."""
  old = None
  if os.path.exists(out_dir) and os.listdir(out_dir):
    listed = dataset_files(out_dir)
    old = tmp + ".old"
    os.rename(out_dir, old)
  elif os.path.exists(out_dir):
    os.rmdir(out_dir)
  os.rename(tmp, out_dir)
  if old:
    for rel in listed:
      if os.path.lexists(os.path.join(old, rel)):
        os.remove(os.path.join(old, rel))
    for root, _, _ in os.walk(old, topdown=False):        # emptied folders, deepest first
      try:
        os.rmdir(root)
      except OSError:
        pass


def write_manifest(out_dir: str, schema, used, files: dict) -> dict:
  """Renames each (split, surface)'s shards ``[(rel, count, bytes, sha256)]`` (in order) to
  ``<surface>-0000i-of-0000N.arrayrecord``, adds an empty shard where a split has no records of
  a surface, then writes ``schema.json`` and ``manifest.json`` (last: its presence marks the
  dataset complete)."""
  manifest = {"format": records.FORMAT, "splits": {}}
  for split in used:
    os.makedirs(os.path.join(out_dir, split), exist_ok=True)
    for surface in schema.surfaces:
      fs = files.get((split, surface), [])
      if not fs:
        rel = os.path.join(split, f".{surface}-empty.tmp")
        array_record_module.ArrayRecordWriter(os.path.join(out_dir, rel),
                                              records.WRITER_OPTIONS).close()
        fs = [(rel, 0, None, None)]
      entries = []
      for i, (rel, c, size, sha) in enumerate(fs):
        final = os.path.join(split, records.shard_name(surface, i, len(fs)))
        os.replace(os.path.join(out_dir, rel), os.path.join(out_dir, final))
        if sha is None:
          entries.append(shards.file_entry(out_dir, final, c))
        else:
          entries.append({"file": final, "count": int(c), "bytes": int(size), "sha256": sha})
      manifest["splits"].setdefault(split, {})[surface] = entries
  schema.save(out_dir)
  with open(os.path.join(out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return manifest
