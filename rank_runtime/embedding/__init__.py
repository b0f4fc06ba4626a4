"""The sparse tables: `create_table` and the shard each rank holds, its native row store and storage
tiers (memory, SSD), the variables a script optimises, and the loader of shardrec's TensorFlow op
library."""
