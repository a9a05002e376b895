"""The service layer between the routes and the rounds: it owns the transactions and the group
commits (requests that arrive together share one transaction). Routes parse and answer only."""
