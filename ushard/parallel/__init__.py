"""The shard_map parts of ushard: each module knows the Layout (ushard.sharding), no model layer."""
