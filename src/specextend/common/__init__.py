"""What every layer uses and that uses nothing of the package: errors that reach the user as one
line (`errors`), generation settings and their one parser (`settings`), JSON Lines (`jsonl`),
progress on stderr (`progress`), counts in messages (`plural`), the host's memory (`meminfo`) and
loading without the garbage collector's full passes (`gc_pause`). No torch, no transformers."""
