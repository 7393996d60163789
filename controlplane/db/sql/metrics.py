"""Statements on `instance_metrics`: the samples of customer databases' own metrics, their
roll-up into coarser rows, their pruning, and the series a customer reads."""

# The sample columns after (instance_id, resolution_s, at), in order.
_COLUMNS = """connections, max_connections, transactions, rows_read, rows_written, blocks_hit,
    blocks_read, size_bytes, allocated_bytes, replication_lag_s, archive_lag_s"""

# Samples of one reconciler pass, one row per instance at the sampling resolution: the first
# sample of an interval is kept (a second pass within it adds nothing).
RECORD_SAMPLES = f"""
INSERT INTO instance_metrics (instance_id, resolution_s, at, {_COLUMNS})
SELECT s.instance_id, %(resolution_s)s,
       date_bin(make_interval(secs => %(resolution_s)s), COALESCE(%(now)s::timestamptz, now()),
                TIMESTAMPTZ '2000-01-01'),
       s.connections, s.max_connections, s.transactions, s.rows_read, s.rows_written, s.blocks_hit,
       s.blocks_read, s.size_bytes, s.allocated_bytes, s.replication_lag_s, s.archive_lag_s
FROM unnest(%(ids)s::uuid[], %(connections)s::int[], %(max_connections)s::int[],
            %(transactions)s::bigint[], %(rows_read)s::bigint[], %(rows_written)s::bigint[],
            %(blocks_hit)s::bigint[], %(blocks_read)s::bigint[], %(size_bytes)s::bigint[],
            %(allocated_bytes)s::bigint[], %(replication_lag_s)s::float8[], %(archive_lag_s)s::float8[])
     AS s(instance_id, {_COLUMNS})
ON CONFLICT (instance_id, resolution_s, at) DO NOTHING
"""

# Roll the fine samples of every bucket completed by `now` (and not rolled up yet, within the fine
# samples' retention) into one coarse row per instance and bucket: counters at their last value,
# connections on average, sizes and lags at their highest. Re-running it changes nothing.
ROLL_UP_SAMPLES = f"""
WITH bounds AS (
    SELECT GREATEST(
               (SELECT max(at) FROM instance_metrics WHERE resolution_s = %(coarse_s)s)
                   + make_interval(secs => %(coarse_s)s),
               %(now)s::timestamptz - make_interval(secs => %(fine_keep_s)s)) AS since,
           date_bin(make_interval(secs => %(coarse_s)s), %(now)s::timestamptz, TIMESTAMPTZ '2000-01-01')
               AS until
)
INSERT INTO instance_metrics (instance_id, resolution_s, at, {_COLUMNS})
SELECT m.instance_id, %(coarse_s)s,
       date_bin(make_interval(secs => %(coarse_s)s), m.at, TIMESTAMPTZ '2000-01-01') AS bucket,
       round(avg(m.connections))::int, max(m.max_connections), max(m.transactions), max(m.rows_read),
       max(m.rows_written), max(m.blocks_hit), max(m.blocks_read), max(m.size_bytes),
       max(m.allocated_bytes), max(m.replication_lag_s), max(m.archive_lag_s)
FROM instance_metrics m, bounds b
WHERE m.resolution_s = %(fine_s)s AND m.at >= b.since AND m.at < b.until
GROUP BY m.instance_id, bucket
ON CONFLICT (instance_id, resolution_s, at) DO NOTHING
"""

# Samples of one resolution older than its retention (ix_instance_metrics_age serves it).
PRUNE_SAMPLES = """
DELETE FROM instance_metrics
WHERE resolution_s = %(resolution_s)s AND at < %(now)s::timestamptz - make_interval(secs => %(keep_s)s)
"""

# One instance's samples of one resolution in [start, end), a row per `step_s` bucket: counters at
# their last value with the time of that sample (rates are the differences between rows),
# connections on average and at their highest, sizes and lags at their highest.
METRICS_SERIES = """
SELECT date_bin(make_interval(secs => %(step_s)s), at, TIMESTAMPTZ '2000-01-01') AS bucket,
       max(at) AS last_at, avg(connections)::float8 AS connections,
       max(connections) AS connections_max, max(max_connections) AS max_connections,
       max(transactions) AS transactions, max(rows_read) AS rows_read,
       max(rows_written) AS rows_written, max(blocks_hit) AS blocks_hit,
       max(blocks_read) AS blocks_read, max(size_bytes) AS size_bytes,
       max(allocated_bytes) AS allocated_bytes, max(replication_lag_s) AS replication_lag_s,
       max(archive_lag_s) AS archive_lag_s
FROM instance_metrics
WHERE instance_id = %(instance_id)s AND resolution_s = %(resolution_s)s
  AND at >= %(start)s AND at < %(end)s
GROUP BY bucket
ORDER BY bucket
"""

# The recent fine samples of some instances: their used space against their allocation (the
# storage autoscaling rule looks at how long it has stayed high).
RECENT_STORAGE = """
SELECT instance_id, at, size_bytes, allocated_bytes
FROM instance_metrics
WHERE instance_id = ANY(%(ids)s::uuid[]) AND resolution_s = %(resolution_s)s AND at >= %(since)s
ORDER BY instance_id, at
"""
