//! OpenLineage mapping, durable relay and Delta Lake sink. Built by the lineage issue.
