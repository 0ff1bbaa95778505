"""Test helper: the named scopes (name stacks) of every equation of a jaxpr, sub-jaxprs included."""


def name_stacks(closed_jaxpr) -> str:
  """All equations' name stacks of ``closed_jaxpr`` (recursing into nested jaxprs), joined."""
  out = []

  def walk(j):
    for eqn in j.eqns:
      out.append(str(eqn.source_info.name_stack))
      for v in eqn.params.values():
        for sub in (v if isinstance(v, (list, tuple)) else [v]):
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)
  walk(closed_jaxpr.jaxpr)
  return " ".join(out)
