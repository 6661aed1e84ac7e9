"""Drive Open WebUI (pointed at meshgate) in headless Chromium: sign up, chat with gemma3:270m, read the title.

Usage: ``drive.py WEBUI_URL OUT_DIR``. Debian's ``/usr/bin/chromium`` through ``/usr/bin/chromedriver`` (as
``tests/e2e/test_dashboard.py``; never Selenium Manager, which would download a browser). Signs up the first
account (Open WebUI's admin), picks ``gemma3:270m``, sends a question, waits for the finished answer and for the
title Open WebUI's title task gives the chat in the sidebar, and prints both with the times. On failure: a
screenshot and the page's HTML under OUT_DIR, and exit status 1.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
MODEL = "gemma3:270m"
SELECTOR = "model-selector-model-button"  # the model picker in the message box
QUESTION = "What is the capital of France?"
NAME, EMAIL, PASSWORD = "Meshgate Check", "admin@example.com", "meshgate-check-password"
# The first chat prefills Open WebUI's ~6k-token prompt (its built-in tools) on a small CPU, then the title task
# and the answer decode side by side; a 270M model may ramble on to the end of its context.
ANSWER_TIMEOUT = float(os.environ.get("ANSWER_TIMEOUT", 600))
ANSWER_SHOWN = 600  # characters of the answer printed

# The last assistant message of the chat: its text, whether it is finished (its "Edit" button shows only then)
# and any error it shows.
LAST_RESPONSE = """
const boxes = document.querySelectorAll('[id^="message-"]');
for (let i = boxes.length - 1; i >= 0; i--) {
  const content = boxes[i].querySelector('#response-content-container');
  if (!content) continue;
  return {
    text: content.innerText.trim(),
    done: !!boxes[i].querySelector('button[aria-label="Edit"]'),
    model: (boxes[i].querySelector('#response-message-model-name') || {}).innerText || '',
  };
}
return null;
"""
# Each sidebar chat's title (its first line; the second says how old it is).
TITLES = (
    "return Array.from(document.querySelectorAll('[data-sidebar-chat-id]'), e => e.innerText.trim().split('\\n')[0])"
)


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    return driver


def click_text(driver: webdriver.Chrome, text: str, timeout: float) -> bool:
    """Click the button showing ``text`` if one appears within ``timeout`` seconds."""
    try:
        button = WebDriverWait(driver, timeout, poll_frequency=0.3).until(
            expected_conditions.element_to_be_clickable((By.XPATH, f'//button[normalize-space()="{text}"]'))
        )
    except TimeoutException:
        return False
    button.click()
    return True


def step(message: str, start: float) -> None:
    print(f"   [{time.monotonic() - start:6.1f} s] {message}", flush=True)


def run(driver: webdriver.Chrome, url: str) -> None:
    start = time.monotonic()
    until = WebDriverWait(driver, 60, poll_frequency=0.3)
    driver.get(url)

    # First visit: the welcome screen, then the sign-up form for the first (admin) account.
    click_text(driver, "Get started", 30)
    until.until(expected_conditions.visibility_of_element_located((By.ID, "name"))).send_keys(NAME)
    driver.find_element(By.ID, "email").send_keys(EMAIL)
    driver.find_element(By.ID, "password").send_keys(PASSWORD)
    if driver.find_elements(By.ID, "confirm-password"):
        driver.find_element(By.ID, "confirm-password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, '#auth-page button[type="submit"]').click()
    until.until(expected_conditions.presence_of_element_located((By.ID, "chat-input")))
    step(f"signed up as {EMAIL} (admin)", start)
    click_text(driver, "Okay, Let's Go!", 5)  # the "what's new" notes a new admin is shown once

    # The model: from the selector's search, as a user would.
    until.until(expected_conditions.element_to_be_clickable((By.ID, SELECTOR))).click()
    until.until(expected_conditions.visibility_of_element_located((By.ID, "model-search-input"))).send_keys(MODEL)
    option = f'//*[@id="model-selector-list"]//*[@role="option"][.//*[normalize-space()="{MODEL}"]]'
    until.until(expected_conditions.element_to_be_clickable((By.XPATH, option))).click()
    until.until(lambda d: MODEL in d.find_element(By.ID, SELECTOR).text)
    step(f"picked {MODEL}", start)

    chat_input = until.until(expected_conditions.element_to_be_clickable((By.ID, "chat-input")))
    chat_input.click()
    chat_input.send_keys(QUESTION)
    until.until(expected_conditions.element_to_be_clickable((By.ID, "send-message-button"))).click()
    sent = time.monotonic()
    step(f"sent {QUESTION!r}", start)

    # The answer streams while Open WebUI's title task runs beside it: watch both until the answer has finished and
    # the sidebar shows the chat's title.
    first = answered = titled = None
    response: dict = {}
    titles: list[str] = []
    seen: list[str] = []
    deadline = sent + ANSWER_TIMEOUT
    while answered is None or titled is None:
        if time.monotonic() > deadline:
            state = f"answer {'finished' if answered else 'not finished'}, title {titles[:1] or 'not shown'}"
            raise TimeoutException(
                f"{ANSWER_TIMEOUT} s after sending: {state}; answer so far: {response.get('text', '')[:300]!r}"
            )
        now = time.monotonic()
        response = driver.execute_script(LAST_RESPONSE) or {}
        if response.get("text") and first is None:
            first = now
            step(f"first text of the answer after {now - sent:.1f} s", start)
        if response.get("done") and answered is None:
            answered = now
            step(f"answer finished after {now - sent:.1f} s ({len(response['text'])} characters)", start)
        shown = driver.execute_script(TITLES)
        if shown[:1] != seen[-1:]:
            seen += shown[:1]
            step(f"sidebar title {shown[:1]} after {now - sent:.1f} s", start)
        titles = [t for t in shown if t and t != "New Chat"]
        if titles and titled is None:
            titled = now
        time.sleep(0.5)

    text = response["text"]
    if "error" in text.lower():
        raise AssertionError(f"the answer shows an error: {text!r}")
    print(
        f"answer ({response['model'] or MODEL}, {len(text)} characters): {text[:ANSWER_SHOWN]}"
        + (" [...]" if len(text) > ANSWER_SHOWN else "")
    )
    fallback = titles[0] == QUESTION
    print(
        f"title: {titles[0]}"
        + (
            ' (the question itself: Open WebUI\'s fallback when the title reply has no JSON {"title": ...})'
            if fallback
            else ""
        )
    )
    print(
        f"times after sending: first text {first - sent:.1f} s, answer finished {answered - sent:.1f} s, "
        f"title {titled - sent:.1f} s; {time.monotonic() - start:.1f} s in the browser in all"
    )


def main() -> int:
    url, out = sys.argv[1], Path(sys.argv[2])
    driver = browser()
    try:
        run(driver, url)
        return 0
    except (TimeoutException, AssertionError, WebDriverException) as error:
        shot, html = out / "open-webui-failure.png", out / "open-webui-failure.html"
        driver.save_screenshot(str(shot))
        html.write_text(driver.page_source)
        print(f"FAILED: {type(error).__name__}: {str(error).strip()[:500]}", file=sys.stderr)
        print(f"screenshot: {shot}; page: {html}", file=sys.stderr)
        return 1
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(main())
