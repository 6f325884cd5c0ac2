"""The privacy budget: RDP privacy filter, the site's policy, the persistent ledger."""
