"""The control plane: state store, planner, instances, node agent."""
