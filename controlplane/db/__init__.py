"""The control plane's database: connections and migrations, the schema, all SQL, the one
transition path, and the row writes of instances and jobs.
"""
