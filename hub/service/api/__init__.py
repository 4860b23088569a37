"""HTTP only: tornado handlers that turn one request into one call of the manager, and the routes. They
import the service's leaf modules and the manager, nothing else of the service.
"""
