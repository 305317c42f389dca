"""Generation, whatever the API: the service that runs a request on its model's engine, the API-neutral
stream every view reads, the conversations `previous_response_id` continues, and the HTTP runner."""
