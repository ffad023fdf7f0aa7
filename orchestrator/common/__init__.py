"""Small pieces every step uses: files read and written safely (`safe_io`), the names inside
a run directory (`layout`), secret redaction (`redact`), process control (`processes`),
addresses and ports (`net`), tables and sentences worded one way (`mdtable`, `wording`), and
what the machine and checkout are (`probes`). fusedq's shared facts come from
`fusedq.contract`, which imports no torch."""
