"""The built-in trainer that a rank pod runs by default, and its workloads (digits, mnist, synthetic, gcn)."""
