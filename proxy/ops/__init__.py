"""The operator's side: auth and bounds, the admin API, the dashboard, metrics, model listing."""
