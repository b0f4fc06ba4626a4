"""From a batch's ids to its rows: the feature specs, the key pipeline that the dataset's insert
function starts (dedup and the key exchange, run ahead of the step), the routing each lookup reads,
`sparse_lookup`, automatic graph modification, and the step profile that says where a step's time
goes."""
