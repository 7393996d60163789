"""The transition statements of instances and jobs (one move or many), and where rows are after a miss."""

from controlplane.db.sql.template import ENTITY_TABLES, _transition

# The per-row input of every transition: which row, from where, by which event, with what patch.
_MOVES_INPUT = """
    SELECT * FROM unnest(
        %(ids)s::uuid[], %(versions)s::bigint[], %(from_states)s::text[], %(to_states)s::text[],
        %(events)s::text[], %(reasons)s::text[], %(details)s::jsonb[], %(patches)s::jsonb[]
    ) AS m(id, expected_version, from_state, to_state, event, reason, detail, patch)
"""


# The same input for exactly one move, as scalar parameters: cheaper to send than arrays.
_MOVE_INPUT = """
    SELECT %(ids)s::uuid AS id, %(versions)s::bigint AS expected_version,
           %(from_states)s::text AS from_state, %(to_states)s::text AS to_state,
           %(events)s::text AS event, %(reasons)s::text AS reason, %(details)s::jsonb AS detail,
           %(patches)s::jsonb AS patch
"""

# Move rows along their lifecycle (one or many): the one transition path.
TRANSITION = {entity: _transition(spec, _MOVES_INPUT) for entity, spec in ENTITY_TABLES.items()}
# The same statement for a single move (scalar parameters instead of arrays).
TRANSITION_ONE = {entity: _transition(spec, _MOVE_INPUT) for entity, spec in ENTITY_TABLES.items()}

# After a transition matched nothing: where the rows really are.
CURRENT_STATES = {
    entity: f"SELECT id, state, state_version FROM {spec.table} WHERE id = ANY(%(ids)s::uuid[])"
    for entity, spec in ENTITY_TABLES.items()
}
