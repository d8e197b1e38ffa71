"""Deterministic generator of the Acme Corp IT/HR helpdesk fine-tuning dataset.

    python -m distlab.datagen          # (re)write data/support/, data/prompts/, data/README.md
    python -m distlab.datagen --check  # exit 1 and name the files that differ from the output
    python -m distlab.datagen --stats  # print row counts and length statistics

The data is built from tables: topics -> intents -> (user phrasings with entity slots, one answer
template). An answer depends only on (intent, entity values), never on the phrasing, so a small
model can learn the mapping and be measured on rows it has not seen. The eval split holds out
one phrasing per intent and a few entity values everywhere (see HELDOUT), so every eval prompt is
new text while every eval intent is also trained on.

Pure standard library, so it runs before torch is installed. Only seeded `random.Random`
instances are used, seeded from strings (which hash with SHA-512, not Python's randomized hash).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import string
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple

SEED = 1234
REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "train": "data/support/train.jsonl",
    "eval": "data/support/eval.jsonl",
    "prompts": "data/prompts/demo_prompts.jsonl",
    "readme": "data/README.md",
}

TRAIN_ROWS = 720
EVAL_ROWS = 120
SYSTEM_SHARE = 0.85  # of messages rows; the rest teach the model to answer without one
MULTI_TURN_SHARE = 0.10  # of messages rows
# Two messages rows per prompt/response and question/answer row gives the 50/25/25 mix exactly.
FORMAT_CYCLE = ("messages", "prompt", "messages", "question")
# Bounds that keep a whole row inside a 256-token sequence with a ~4k-vocab BPE tokenizer.
MIN_ANSWER_WORDS, MAX_ANSWER_WORDS, MAX_ROW_WORDS = 12, 110, 160


class Intent(NamedTuple):
    name: str
    phrasings: tuple[str, ...]  # every phrasing uses the same {slots}
    answer: str  # may also use the fields DERIVED from those slots


class Topic(NamedTuple):
    category: str
    escalation: str  # the assistant's reply to a generic "what if that doesn't work?" follow-up
    intents: tuple[Intent, ...]


# --------------------------------------------------------------------------------------------
# Entities. Values are written so that they read correctly after "the", "my" or on their own.
# --------------------------------------------------------------------------------------------

SLOT_VALUES: dict[str, tuple] = {
    "app": ("Workday", "SAP Concur", "ServiceNow", "Outlook", "Slack", "Jira", "Salesforce",
            "Zoom", "Confluence"),
    "city": ("London", "New York", "Berlin", "Singapore", "Toronto", "Austin", "Dublin", "Sydney",
             "Bangalore", "Paris"),
    "department": ("Finance", "Marketing", "Engineering", "Sales", "Legal", "Customer Support",
                   "Operations", "Product", "Data Science"),
    "name": ("Priya", "Tom", "Aisha", "Lukas", "Mei", "Carlos", "Fatima", "James", "Sofia",
             "Kenji", "Olu", "Hannah", "Diego", "Ana"),
    "phone": ("iPhone 15", "iPhone 13", "Pixel 8", "Galaxy S23", "Galaxy A54", "Pixel 7a"),
    "laptop": ("Dell Latitude 7440", "MacBook Pro 14", "Lenovo ThinkPad X1 Carbon",
               "HP EliteBook 840", "MacBook Air 13", "Lenovo ThinkPad T14"),
    "accessory": ("second monitor", "docking station", "USB-C headset", "wireless keyboard",
                  "webcam", "laptop stand", "monitor arm"),
    "software": ("Tableau Desktop", "Visual Studio Code", "Adobe Acrobat Pro", "Figma",
                 "Docker Desktop", "Power BI Desktop", "Miro", "Python 3.12", "Postman",
                 "Notepad++"),
    "floor": ("2nd", "3rd", "4th", "5th", "6th", "7th"),
    "room": ("Orion", "Vega", "Lyra", "Atlas", "Nova", "Juno", "Polaris", "Sirius"),
    "month": ("January", "February", "March", "April", "May", "June", "July", "August",
              "September", "October", "November", "December"),
    "start_date": ("3 March", "14 April", "6 May", "2 June", "7 July", "1 September",
                   "6 October", "1 December"),
    "amount": (12, 18, 24, 25, 40, 65, 140, 320, 890),
    "expense_item": ("taxi", "client dinner", "train ticket", "conference ticket", "hotel night",
                     "team lunch", "parking fee"),
    "leave_days": (2, 3, 4, 5, 6, 8, 10, 12, 15),
    "sick_days": (2, 3, 4, 5, 6, 7),
    "flight_hours": (2, 3, 4, 5, 7, 8, 10, 12, 14),
    "nightly_rate": (140, 190, 230, 250, 275, 320, 410),
    "country": ("Spain", "Portugal", "Italy", "Japan", "Mexico", "Greece", "Canada", "Thailand",
                "Poland"),
    "life_event": ("got married", "had a baby", "adopted a child", "got divorced",
                   "entered a civil partnership", "lost coverage under a partner's plan"),
    "benefit_plan": ("medical", "dental", "vision", "pension", "life insurance", "commuter"),
    "phishing_lure": ("a fake DocuSign link", "a suspicious invoice attachment",
                      "a password expiry warning", "a gift card request from the CEO",
                      "a shared OneDrive file", "a parcel delivery notice",
                      "a payroll update link"),
}

# Values that never occur in train. Numeric ones sit on both sides of the policy thresholds,
# so eval also tests whether the model learned the rule rather than the number.
HELDOUT: dict[str, tuple] = {
    "app": ("Zoom", "Confluence"),
    "city": ("Dublin", "Sydney"),
    "department": ("Legal", "Data Science"),
    "name": ("Kenji", "Hannah"),
    "phone": ("Pixel 7a",),
    "laptop": ("HP EliteBook 840",),
    "accessory": ("webcam",),
    "software": ("Postman", "Miro"),
    "floor": ("7th",),
    "room": ("Juno",),
    "month": ("August", "November"),
    "start_date": ("6 October",),
    "amount": (18, 140),
    "expense_item": ("parking fee",),
    "leave_days": (4, 12),
    "sick_days": (4,),
    "flight_hours": (4, 10),
    "nightly_rate": (230, 320),
    "country": ("Greece", "Thailand"),
    "life_event": ("adopted a child",),
    "benefit_plan": ("vision",),
    "phishing_lure": ("a parcel delivery notice",),
}


# Policy rules that turn a numeric slot into sentence fragments. Keeping the thresholds in code
# (not per-value text) guarantees the answers apply one consistent policy.

def _amount_rules(amount: int) -> dict[str, str]:
    if amount > 25:
        return {
            "receipt_rule": f"Because ${amount} is over $25, attach an itemised receipt.",
            "missing_receipt_rule": (
                f"Because ${amount} is over $25, a receipt is required, so attach a signed "
                "Missing Receipt Declaration in SAP Concur instead. You can use a declaration "
                "at most 3 times a year, and your manager must approve it."),
        }
    return {
        "receipt_rule": "Receipts are only required over $25, so none is needed for this one.",
        "missing_receipt_rule": (
            f"Receipts are only required over $25, so you can claim the ${amount} in SAP "
            "Concur without one; just describe the expense in the comment field."),
    }


def _leave_rules(days: int) -> dict[str, str]:
    if days > 10:
        notice = ("Because it is more than 10 consecutive days, it needs director approval "
                  "after your manager approves, and at least 2 weeks' notice.")
    elif days > 5:
        notice = "Because it is more than 5 days, request it at least 2 weeks in advance."
    else:
        notice = "For 5 days or fewer, 2 working days' notice is enough."
    if days > 5:
        carry = (f"Only 5 days carry over, so use the other {days - 5} before 31 December "
                 "or they are lost.")
    else:
        carry = f"Up to 5 days carry over, so all {days} days move to next year automatically."
    return {"leave_rule": notice, "carry_rule": carry}


def _sick_rules(days: int) -> dict[str, str]:
    if days > 3:
        note = "As it is more than 3 days, upload a doctor's note to the absence in Workday."
    else:
        note = "Up to 3 days you can self-certify, so no doctor's note is needed."
    if days > 5:
        care = (f"The first 5 days are paid family care leave; the other {days - 5} are taken "
                "from annual leave or as unpaid leave, agreed with your manager.")
    else:
        care = f"All {days} days are covered by paid family care leave (5 days per year)."
    return {"sick_rule": note, "care_rule": care}


def _flight_rules(hours: int) -> dict[str, str]:
    return {"flight_class": "economy" if hours < 6 else "premium economy"}


def _hotel_rules(rate: int) -> dict[str, str]:
    if rate > 250:
        return {"hotel_rule": "is above the $250 per-night cap, so it needs your manager's "
                              "pre-approval in SAP Concur Travel before you book"}
    return {"hotel_rule": "is within the $250 per-night cap, so you can book it directly in "
                          "SAP Concur Travel"}


DERIVED: dict[str, Callable[[int], dict[str, str]]] = {
    "amount": _amount_rules,
    "leave_days": _leave_rules,
    "sick_days": _sick_rules,
    "flight_hours": _flight_rules,
    "nightly_rate": _hotel_rules,
}

SYSTEM_PROMPTS = (
    "You are the Acme Corp internal helpdesk assistant. Answer employees' IT and HR questions "
    "accurately and concisely, following company policy.",
    "You are Acme Corp's IT and HR helpdesk assistant. Give clear, step-by-step answers based "
    "on Acme policy.",
    "You are the internal support assistant for Acme Corp employees. Be brief, friendly and "
    "exact about policy numbers.",
    "You are a helpful assistant on the Acme Corp employee helpdesk for IT, HR, finance and "
    "travel questions.",
)

FOLLOW_UPS = (
    "Thanks. What if that doesn't work?",
    "ok, and who do I contact if I'm still stuck?",
    "Great, thank you. Who can help if I have more questions?",
    "thx. and if it still doesnt work?",
)

# --------------------------------------------------------------------------------------------
# Topics and intents. Phrasings mix polite, terse, typo-ish, question and statement forms.
# --------------------------------------------------------------------------------------------

IT_DESK = "call the IT service desk on ext. 2000"

TOPICS: tuple[Topic, ...] = (
    Topic("password_reset",
          f"If that doesn't work, {IT_DESK} (24/7) or raise a ticket in the ServiceNow portal "
          "under Access > Password.",
          (
              Intent("forgot_password", (
                  "How do I reset my {app} password?",
                  "forgot my {app} password",
                  "Hi, I can't remember my password for {app}. Could you tell me how to reset "
                  "it, please?",
                  "i forgot my {app} pasword and cant log in",
                  "Need a password reset for {app}.",
              ), "{app} signs in through Okta, so you reset your Okta password: go to "
                 "login.acme.example, click \"Forgot password?\", verify with Okta Verify and "
                 "choose a new password of at least 14 characters. {app} accepts the new "
                 "password within 5 minutes."),
              Intent("account_locked", (
                  "My {app} account is locked. What should I do?",
                  "locked out of {app}",
                  "Hello, after a few wrong attempts {app} has locked me out. Can you unlock "
                  "it?",
                  "{app} says my acount is locked??",
                  "Why am I locked out of {app} and how do I get back in?",
              ), "{app} locks your account after 5 failed sign-ins. It unlocks itself after 30 "
                 "minutes, or unlock it now at login.acme.example with \"Unlock account\" and "
                 "Okta Verify. If it locks again straight away, an old password is probably "
                 "saved on your phone or laptop; update it there first."),
              Intent("password_expiry", (
                  "How often do I have to change my {app} password?",
                  "{app} password expiring soon - how do i change it",
                  "I got a warning that my {app} password expires. Can I change it early?",
                  "What are the password rules for {app}?",
                  "Could you explain the password policy for {app}, please?",
              ), "{app} uses your Okta password, which expires every 90 days; you get an email "
                 "reminder 14 days before. Change it any time at login.acme.example > Settings "
                 "> Change password. It must be at least 14 characters and cannot reuse any of "
                 "your last 10 passwords."),
          )),
    Topic("vpn_access",
          "If it still fails, raise a ServiceNow ticket under Network > VPN with a screenshot "
          f"of the error, or {IT_DESK}.",
          (
              Intent("vpn_request", (
                  "How do I get VPN access? I'm in {department}.",
                  "need vpn access, {department} team",
                  "Hi, I just joined {department} and need to work remotely. How can I request "
                  "VPN access?",
                  "I work in {department}. Who approves VPN requests?",
                  "vpn acess for {department} pls",
              ), "Request it in ServiceNow under Catalog > Remote Access > GlobalProtect VPN. "
                 "Your {department} manager approves it, usually within 1 working day. Then "
                 "install GlobalProtect from Company Portal (Windows) or Self Service (Mac) and "
                 "connect to vpn.acme.example with your Okta sign-in."),
              Intent("vpn_not_connecting", (
                  "The VPN won't connect from {city}. Any ideas?",
                  "globalprotect not connecting in {city}",
                  "I'm working from {city} this week and GlobalProtect keeps failing to "
                  "connect. What can I try?",
                  "vpn broken, {city} hotel wifi",
                  "Why does GlobalProtect say gateway unreachable when I'm in {city}?",
              ), "From {city}, try these steps in order: 1. Check the internet works without "
                 "the VPN and accept any hotel or guest Wi-Fi login page. 2. In GlobalProtect, "
                 "open Settings and choose Refresh Connection. 3. Pick the nearest gateway "
                 "manually instead of Best Available. 4. Restart the laptop and connect again "
                 "to vpn.acme.example. Most failures on guest networks are fixed by steps 1 "
                 "and 3."),
              Intent("vpn_slow", (
                  "The VPN is really slow in {city}, is that normal?",
                  "slow vpn {city}",
                  "Everything is very slow over GlobalProtect when I work from {city}. Can this "
                  "be fixed?",
                  "Do I need the VPN on for Outlook and Slack? It's so slow from {city}.",
                  "vpn super laggy from {city} today",
              ), "Outlook, Slack, Zoom and Workday work without the VPN, so only connect for "
                 "internal systems. From {city}, select the closest gateway in GlobalProtect "
                 "and keep video calls and large downloads off the VPN."),
          )),
    Topic("mfa",
          f"If you are still stuck, {IT_DESK}; they verify your identity on a video call "
          "before changing anything about your MFA.",
          (
              Intent("mfa_new_phone", (
                  "I got a new {phone}. How do I move Okta Verify to it?",
                  "new phone ({phone}), need to set up MFA",
                  "Hello, I'm switching to a new {phone} next week. What do I need to do for "
                  "multi-factor authentication?",
                  "how to transfer okta verify to my {phone}",
                  "Can I use my new {phone} for MFA?",
              ), "Before you wipe the old phone, install Okta Verify on your {phone}. Then go "
                 "to login.acme.example > Settings > Security Methods, click Set up next to "
                 "Okta Verify and scan the QR code with the {phone}. Test one sign-in, then "
                 "remove the old phone on the same page."),
              Intent("mfa_lost_phone", (
                  "I lost my {phone} and can't do MFA. Help!",
                  "lost phone ({phone}), no okta verify",
                  "My {phone} was stolen yesterday and it had my authenticator on it. What "
                  "should I do?",
                  "phone gone ({phone}) cant log in mfa",
                  "Someone took my {phone}. How do I get back into my accounts?",
              ), "Call the IT service desk on ext. 2000 straight away. After verifying your "
                 "identity they remove the lost {phone} from Okta and give you a temporary "
                 "passcode valid for 24 hours. If the {phone} was stolen, also report it to the "
                 "security hotline on ext. 4444. Then set up Okta Verify on your replacement "
                 "phone."),
              Intent("mfa_no_push", (
                  "Okta Verify push notifications aren't arriving on my {phone}.",
                  "no mfa push on {phone}",
                  "Hi, I'm not getting the Okta push on my {phone} any more. How can I fix it?",
                  "okta verify not notifying on my {phone}??",
                  "Why doesn't my {phone} get the MFA prompt?",
              ), "Open Okta Verify on your {phone} and type the 6-digit code instead of waiting "
                 "for the push. Then allow notifications for Okta Verify and turn off battery "
                 "saving for the app."),
          )),
    Topic("expense_policy",
          "For anything else, ask the Finance expenses team in ServiceNow under Finance > "
          "Expenses, or call them on ext. 5100.",
          (
              Intent("submit_expense", (
                  "How do I claim back ${amount} for a {expense_item}?",
                  "expense claim: {expense_item}, ${amount}",
                  "Hi, I paid ${amount} for a {expense_item} on a work trip. How do I get "
                  "reimbursed?",
                  "Do I need a receipt for a ${amount} {expense_item}?",
                  "i spent ${amount} on a {expense_item} for work, how to expense it",
              ), "Submit the ${amount} {expense_item} in SAP Concur within 30 days of paying. "
                 "{receipt_rule} Your manager approves it in Concur and it is paid with the "
                 "next monthly payroll."),
              Intent("expense_deadline", (
                  "Can I still claim expenses from {month}?",
                  "late expenses from {month}",
                  "Hello, I have some receipts from {month} that I never submitted. Can I still "
                  "claim them?",
                  "what's the deadline for {month} expenses",
                  "oops, forgot my {month} expense report",
              ), "Expenses are due in SAP Concur within 30 days. If your {month} claims are "
                 "late, submit them anyway with a short reason in the comment field: claims up "
                 "to 90 days old can be approved by your manager and Finance, and older ones "
                 "are not reimbursed."),
              Intent("lost_receipt", (
                  "I lost the receipt for a ${amount} expense. What now?",
                  "no receipt, ${amount}",
                  "I can't find the receipt for the ${amount} I spent on work. Can I still "
                  "claim it?",
                  "lost reciept ${amount} claim??",
                  "Is a missing receipt a problem for a ${amount} claim?",
              ), "{missing_receipt_rule}"),
          )),
    Topic("annual_leave",
          "For questions about your balance, open Ask HR in Workday or call HR on ext. 3000.",
          (
              Intent("book_leave", (
                  "How do I book {leave_days} days of annual leave in {month}?",
                  "want {leave_days} days off in {month}",
                  "Hi, I'd like to take {leave_days} days of holiday in {month}. What's the "
                  "process?",
                  "taking {leave_days} days vacation in {month}, what do i do",
                  "What notice do I need to give for {leave_days} days off in {month}?",
              ), "Request the {leave_days} days in Workday under Time Off > Request Time Off "
                 "and pick your {month} dates; your manager gets the approval task. "
                 "{leave_rule} Full-time staff get 25 days of annual leave per year."),
              Intent("leave_allowance", (
                  "How much annual leave do we get in {department}?",
                  "annual leave allowance {department}",
                  "Hi, I'm new in {department}. Could you tell me how many holiday days I get?",
                  "how many vacation days for {department} staff",
                  "Is the leave allowance different for {department}?",
              ), "Everyone in {department} gets 25 days of annual leave a year, pro-rated in "
                 "your first year."),
              Intent("carry_over", (
                  "Can I carry over {leave_days} unused days of leave to next year?",
                  "carry over {leave_days} days?",
                  "Hello, I still have {leave_days} days of annual leave left. Will they roll "
                  "over into next year?",
                  "{leave_days} days leave left, do i lose them",
                  "What happens to my {leave_days} remaining holiday days at year end?",
              ), "{carry_rule} Carried-over days must be used by 31 March. Check your balance "
                 "in Workday under Time Off > Balances."),
          )),
    Topic("sick_leave",
          "For longer absences or a phased return to work, contact HR via Ask HR in Workday "
          "or on ext. 3000.",
          (
              Intent("record_sickness", (
                  "I've been off sick for {sick_days} days. What do I need to do?",
                  "sick {sick_days} days, need a doctors note?",
                  "Hello, I was ill for {sick_days} days last week. How do I record it?",
                  "Do I need a doctor's note for {sick_days} days of sick leave?",
                  "was sick {sick_days} days how do i log it",
              ), "Record the {sick_days} days in Workday under Time Off > Sick Leave. "
                 "{sick_rule} You have 10 days of paid sick leave per year."),
              Intent("call_in_sick", (
                  "I'm unwell today. My manager is {name}. Who do I need to tell?",
                  "sick today, manager is {name}",
                  "Hi, I woke up ill. How do I let {name}, my manager, know?",
                  "feeling sick cant come in, manager {name}, what do i do",
                  "What's the process for calling in sick? I report to {name}.",
              ), "Tell {name} before 10:00 by phone or Slack; an email alone is not enough. "
                 "When you are back, log the absence in Workday under Time Off > Sick Leave. "
                 "Up to 3 days need no doctor's note."),
              Intent("family_care", (
                  "My child is ill and I need {sick_days} days off to look after them. Is that "
                  "paid?",
                  "kid sick, need {sick_days} days off",
                  "Hello, my partner is in hospital and I need {sick_days} days at home to care "
                  "for the family. What leave can I use?",
                  "need {sick_days} days carers leave, how does it work",
                  "Can I take {sick_days} days of family care leave?",
              ), "Log it in Workday under Time Off > Family Care Leave and tell your manager "
                 "the same day. {care_rule}"),
          )),
    Topic("onboarding",
          "For anything else about a new starter, contact the People team via Ask HR in "
          "Workday or on ext. 3000.",
          (
              Intent("prepare_new_hire", (
                  "{name} is joining {department} on {start_date}. What do I need to set up?",
                  "new hire {name}, {department}, starts {start_date}",
                  "Hi, I'm the manager for {name}, who starts in {department} on {start_date}. "
                  "What's the onboarding checklist?",
                  "how do i onboard {name} ({department}) starting {start_date}",
                  "What should a manager do before a new starter like {name} arrives in "
                  "{department} on {start_date}?",
              ), "For {name} starting in {department} on {start_date}: 1. Check the New Hire "
                 "request is complete in Workday at least 10 working days before {start_date}; "
                 "that triggers the accounts and the laptop order. 2. IT ships the laptop to "
                 "arrive 3 working days before the start. 3. Request extra software or shared "
                 "mailbox access for {department} in ServiceNow. 4. Pick an onboarding buddy "
                 "from the team. 5. Book a 30-minute welcome call for the first morning; "
                 "company orientation starts at 9:30. 6. In the first week, walk {name} through "
                 "the team's tools and agree 30-, 60- and 90-day goals in Workday."),
              Intent("first_day", (
                  "It's my first day at the {city} office. Where do I go?",
                  "first day {city} office, where to go",
                  "Hello! I'm starting at the {city} office on Monday. What happens on day one?",
                  "1st day tomorrow in {city}, what do i bring",
                  "Where should new starters go on their first day in {city}?",
              ), "Welcome! At the {city} office, go to reception at 9:00 with photo ID to "
                 "collect your badge. Orientation starts at 9:30, and IT sets up your laptop "
                 "with you there. Your Okta activation email is sent to your personal address "
                 "the day before."),
              Intent("new_hire_no_login", (
                  "{name} started today but can't log in to anything. What should we do?",
                  "new starter {name} no login",
                  "Hi, our new team member {name} hasn't received any account details. Can you "
                  "help?",
                  "{name} has no okta account yet??",
                  "Why doesn't {name}, who joined this week, have a working login?",
              ), "Accounts are created automatically 5 working days before the start date. "
                 "Ask {name} to check their personal inbox, including spam, for the Okta "
                 f"activation email. If it never arrived, {IT_DESK} with {{name}}'s employee ID "
                 "and they will resend it."),
          )),
    Topic("security_incident",
          "When in doubt, call the security hotline on ext. 4444 (24/7) or email "
          "security@acme.example.",
          (
              Intent("report_phishing", (
                  "I got an email with {phishing_lure}. I think it's phishing.",
                  "suspicious email, {phishing_lure}",
                  "Hello, I received {phishing_lure} from an address I don't recognise. What "
                  "should I do?",
                  "is this phishing? got {phishing_lure}, how do i report it",
                  "pretty sure the email with {phishing_lure} in my inbox is fake",
              ), "Don't click links, open attachments or reply. Report the email with "
                 "{phishing_lure} using the Report Phishing button in Outlook; it goes to the "
                 "security team and leaves your inbox. If you already clicked or entered your "
                 "password, call the security hotline on ext. 4444 immediately."),
              Intent("clicked_phishing", (
                  "I clicked on {phishing_lure} before I realised it was phishing.",
                  "clicked {phishing_lure}, oh no",
                  "I think I typed my password after opening {phishing_lure}. What do I do "
                  "now?",
                  "opened {phishing_lure} by mistake, am i in trouble",
                  "What should I do if I already clicked {phishing_lure}?",
              ), "Act now: 1. Disconnect the laptop from Wi-Fi and the VPN. 2. Call the "
                 "security hotline on ext. 4444 (24/7) and say you opened {phishing_lure}. "
                 "3. From another device, reset your Okta password at login.acme.example. "
                 "4. Don't wipe or switch off the laptop, because security may need to examine "
                 "it. 5. For the next few days, deny any MFA prompt you did not start and "
                 "report it to ext. 4444. Reporting quickly is never a disciplinary matter."),
              Intent("lost_laptop", (
                  "I left my {laptop} in a taxi in {city}. What should I do?",
                  "lost my {laptop} in {city}",
                  "Hi, my {laptop} was stolen from my hotel in {city} last night. Who do I "
                  "tell?",
                  "{laptop} missing after trip to {city}!!",
                  "How do I report a lost {laptop}? It happened in {city}.",
              ), "Report it within 1 hour: call the security hotline on ext. 4444 so they can "
                 "lock and wipe the {laptop} remotely. If it was stolen, file a police report "
                 "in {city} and add the reference to the ServiceNow incident security opens. "
                 "IT then ships a replacement."),
          )),
    Topic("hardware_request",
          "To follow up, check your request in ServiceNow under My Requests or call the IT "
          "service desk on ext. 2000.",
          (
              Intent("new_laptop", (
                  "How can I get a new {laptop}?",
                  "need a {laptop}",
                  "Hi, my laptop is 4 years old. Could I request a {laptop} as a replacement?",
                  "can i get a {laptop} instead of my current one",
                  "I'd like to order a {laptop} for work.",
              ), "Laptops are refreshed every 4 years, or sooner if faulty. Order the {laptop} "
                 "in ServiceNow under Catalog > Hardware > Laptop; your manager approves it "
                 "and it ships within 5 working days. Return the old laptop within 14 days with "
                 "the prepaid label."),
              Intent("order_accessory", (
                  "Can I order a {accessory}?",
                  "need {accessory}",
                  "Hello, how do I request a {accessory} for my desk?",
                  "who pays for a {accessory}",
                  "{accessory} request pls",
              ), "Order the {accessory} in ServiceNow under Catalog > Hardware > Accessories; "
                 "items up to $150 need no approval."),
              Intent("broken_laptop", (
                  "My {laptop} won't turn on.",
                  "{laptop} broken",
                  "Hi, my {laptop} keeps crashing and now the screen stays black. What can I "
                  "do?",
                  "laptop dead ({laptop}) need help asap",
                  "Who fixes a faulty {laptop}?",
              ), "Raise a ServiceNow incident under Hardware > Laptop Fault with the asset tag "
                 "from the sticker under your {laptop}. If you can't work, ask for a loaner "
                 "laptop on ext. 2000 and collect it the same day from your office IT desk. "
                 "Repairs take about 3 working days."),
          )),
    Topic("software_install",
          "If the install fails, raise a ServiceNow incident under Software > Install Failure "
          f"or {IT_DESK}.",
          (
              Intent("install_software", (
                  "How do I install {software}?",
                  "install {software}",
                  "Hi, I need {software} for a project. Can I install it myself?",
                  "cant install {software}, says i need admin",
                  "Where can I download {software} for my work laptop?",
              ), "Open Company Portal (Windows) or Self Service (Mac) and search for "
                 "{software}. If it is listed, click Install; no admin rights are needed. If "
                 "not, raise a Software Request in ServiceNow; new software needs a security "
                 "review of up to 5 working days."),
              Intent("software_licence", (
                  "Who pays for {software} licences for the {department} team?",
                  "{software} licence for {department}",
                  "Hello, a few of us in {department} need {software}. How do we get licences?",
                  "need paid {software} for {department}, who approves",
                  "Is {software} charged to {department}?",
              ), "Paid licences for {software} are charged to the {department} cost centre, so "
                 "a manager in {department} approves the Software Request in ServiceNow. "
                 "Licences unused for 60 days are reclaimed automatically."),
              Intent("admin_rights", (
                  "Can I get admin rights to install {software}?",
                  "admin rights for {software}",
                  "Hi, {software} wants an administrator password. Could I have local admin on "
                  "my laptop?",
                  "need admin to install {software} asap",
                  "Why can't I have admin access to set up {software}?",
              ), "Local admin rights are not given out, because they are the main way malware "
                 "spreads. Install {software} from Company Portal or Self Service if it is "
                 "listed. Developers who need admin for testing can request a 24-hour elevated "
                 "session in ServiceNow under Access > Temporary Admin, approved by their "
                 "manager."),
          )),
    Topic("printer_issues",
          "If the printer still doesn't work, raise a ServiceNow incident under Hardware > "
          "Printer with the printer name from its label.",
          (
              Intent("printer_setup", (
                  "How do I add the {floor} floor printer in {city}?",
                  "printer setup {city} {floor} floor",
                  "Hi, I'm new in the {city} office. How do I print to the printer on the "
                  "{floor} floor?",
                  "cant find {floor} floor printer in {city}",
                  "Which printer should I use on the {floor} floor of the {city} office?",
              ), "All {city} printers use PaperCut secure print, so you only add one queue, "
                 "Acme-Print, from Company Portal or Self Service. Print as usual, then tap "
                 "your badge on any printer, including the one on the {floor} floor, to "
                 "release the job. Jobs wait for 24 hours."),
              Intent("paper_jam", (
                  "The {floor} floor printer in {city} keeps jamming.",
                  "paper jam {floor} floor {city}",
                  "Hello, the printer on the {floor} floor in {city} says paper jam. How do I "
                  "clear it?",
                  "{city} {floor} flr printer jammed again",
                  "How do I fix the jam in the {floor} floor printer in {city}?",
              ), "Open the front panel of the {floor} floor printer and follow the on-screen "
                 "animation to remove the paper; never pull paper out from the back. If it "
                 "jams again, switch it off for 30 seconds. Facilities refills paper and toner "
                 "in {city}; request it in ServiceNow under Facilities."),
              Intent("print_job_missing", (
                  "My print job isn't coming out in {city}. Why?",
                  "printing not working {city}",
                  "Hi, I sent something to print in the {city} office but nothing happens when "
                  "I tap my badge. Can you help?",
                  "{city} printer ignores my badge",
                  "Where did my print job go? I'm in {city}.",
              ), "Check print.acme.example, which shows your queued jobs for 24 hours. If the "
                 "job is there, tap your badge again; if the {city} printer doesn't recognise "
                 "your badge, register it once on the printer screen with your Okta login. If "
                 "the job is missing, remove and re-add the Acme-Print queue."),
          )),
    Topic("email_calendar",
          "For anything else in Outlook, raise a ServiceNow ticket under Email & Calendar or "
          f"{IT_DESK}.",
          (
              Intent("out_of_office", (
                  "How do I set an out-of-office reply for {month}?",
                  "out of office {month}",
                  "Hi, I'm away for part of {month}. How do I set up automatic replies in "
                  "Outlook?",
                  "how to set ooo in outlook for {month}",
                  "I need an auto-reply while I'm off in {month}.",
              ), "In Outlook, go to File > Automatic Replies (on Mac: Tools > Out of Office), "
                 "turn it on and set the start and end dates in {month}. Write one message for "
                 "internal and one for external senders, and name a colleague to contact while "
                 "you are away."),
              Intent("shared_mailbox", (
                  "How can I get access to the {department} shared mailbox?",
                  "need {department} shared mailbox",
                  "Hello, could you add me to the {department} team mailbox, please?",
                  "cant see {department} shared inbox in outlook",
                  "Who grants access to the {department} mailbox?",
              ), "Request it in ServiceNow under Catalog > Email > Shared Mailbox Access and "
                 "choose the {department} mailbox. The mailbox owner approves it, and it "
                 "appears in Outlook within 2 hours of approval; restart Outlook if it doesn't."),
              Intent("calendar_delegate", (
                  "How do I let {name} manage my calendar?",
                  "give {name} access to my calendar",
                  "Hi, {name} is going to schedule meetings for me. How do I share my calendar "
                  "with them?",
                  "make {name} my calendar delegate",
                  "Can {name} accept meeting invites on my behalf?",
              ), "In Outlook, open File > Account Settings > Delegate Access, click Add and "
                 "choose {name}. Give {name} Editor rights on your calendar so they can accept "
                 "meetings for you. You can remove the access on the same screen at any time."),
              Intent("book_room", (
                  "How do I book the {room} meeting room in {city}?",
                  "book {room} room {city}",
                  "Hello, I'd like to reserve the {room} room at the {city} office for a "
                  "workshop. How does that work?",
                  "{room} room in {city} - how to reserve",
                  "Can I book {room} in the {city} office from Outlook?",
              ), "In Outlook, create a meeting, open Room Finder, pick the {city} office and "
                 "select {room}. The room is yours once it accepts the invitation. Bookings "
                 "not checked in on the room panel within 10 minutes are released."),
          )),
    Topic("travel_booking",
          "For other travel questions, contact the travel desk in ServiceNow under Travel or "
          "on ext. 5200.",
          (
              Intent("flight_class", (
                  "My flight to {city} is {flight_hours} hours. What class can I book?",
                  "{flight_hours}h flight to {city}, business class ok?",
                  "Hi, I'm flying to {city} for a customer visit, about {flight_hours} hours. "
                  "Which cabin am I allowed?",
                  "can i book premium economy for {flight_hours} hrs to {city}",
                  "What's the flight policy for a {flight_hours}-hour trip to {city}?",
              ), "For a {flight_hours}-hour flight to {city} you can book {flight_class}. The "
                 "rule is economy under 6 hours and premium economy for 6 hours or more; "
                 "business class needs VP approval. Book in SAP Concur Travel at least 14 days "
                 "ahead."),
              Intent("hotel_rate", (
                  "Can I book a ${nightly_rate} per night hotel in {city}?",
                  "hotel {city} ${nightly_rate}/night ok?",
                  "Hello, the hotel near our {city} customer costs ${nightly_rate} a night. Is "
                  "that within policy?",
                  "is ${nightly_rate} a night too much for {city}",
                  "What's the hotel limit? I found one in {city} for ${nightly_rate}.",
              ), "A ${nightly_rate} hotel in {city} {hotel_rule}. The cap includes breakfast; "
                 "other meals are covered by the $60 daily meal allowance."),
              Intent("book_trip", (
                  "How do I book a business trip to {city}?",
                  "business trip {city}, how to book",
                  "Hi, I need to visit the team in {city} next month. Where do I book travel?",
                  "can i book my {city} trip on expedia",
                  "What's the process for travelling to {city} for work?",
              ), "Book flights, hotels and trains for {city} in SAP Concur Travel at least 14 "
                 "days ahead; Concur sends the trip to your manager for approval. Don't book "
                 "on personal sites, because only Concur bookings are covered by company "
                 "travel insurance."),
          )),
    Topic("remote_work",
          "For your own arrangement, talk to your manager first, then contact HR via Ask HR "
          "in Workday if needed.",
          (
              Intent("remote_days", (
                  "How many days a week can I work from home in {department}?",
                  "wfh days {department}?",
                  "Hi, I'm in {department}. What's the policy on working remotely?",
                  "how much remote work is allowed in {department}",
                  "Can people in {department} work from home full time?",
              ), "Everyone, including {department}, can work remotely up to 3 days a week, "
                 "agreed with their manager. Each department sets its own office anchor days, "
                 "so ask your {department} manager which days you are expected in."),
              Intent("work_abroad", (
                  "Can I work from {country} for a few weeks?",
                  "work remotely from {country}?",
                  "Hello, I'm visiting family in {country}. Could I work from there for a "
                  "while?",
                  "wanna work from {country} for a bit, allowed?",
                  "What's the rule for working abroad in {country}?",
              ), "You can work from abroad for up to 20 working days per year. Submit a Work "
                 "From Abroad request in Workday at least 4 weeks before travelling to "
                 "{country}; HR and Tax check it before your manager gives final approval. "
                 "Don't travel until it is approved."),
              Intent("home_office", (
                  "Does the company pay for a {accessory} for my home office?",
                  "{accessory} for home office?",
                  "Hi, I work from home two days a week. Can I get a {accessory} for my desk "
                  "there?",
                  "can i expense a {accessory} for wfh",
                  "Who covers the cost of a {accessory} at home?",
              ), "Yes. Order a standard {accessory} in ServiceNow under Catalog > Hardware > "
                 "Accessories with your home address for delivery; it is free for your team. "
                 "For other home office furniture, such as a chair, you can claim up to $300 "
                 "once in SAP Concur under Home Office."),
          )),
    Topic("payroll",
          "For pay questions, contact Payroll via Ask HR in Workday or on ext. 3100.",
          (
              Intent("payday", (
                  "When do we get paid in {month}?",
                  "payday {month}?",
                  "Hi, could you tell me which day salary is paid in {month}?",
                  "when is {month} pay day",
                  "What date does the {month} salary arrive?",
              ), "Salary is paid on the last working day of each month, so your {month} pay "
                 "arrives on the last working day of {month}."),
              Intent("payslip_error", (
                  "My {month} payslip looks wrong. What should I do?",
                  "{month} payslip wrong",
                  "Hello, I think my overtime is missing from my {month} payslip. Who can check "
                  "it?",
                  "pay for {month} is less than expected??",
                  "How do I query an error on my {month} payslip?",
              ), "Open the {month} payslip in Workday under Pay > Payslips, then raise an Ask "
                 "HR case under Payroll > Pay Query naming the line you think is wrong. "
                 "Payroll replies within 2 working days, and corrections are paid in the next "
                 "payroll run."),
              Intent("bank_details", (
                  "How do I change my bank details before the {month} payday?",
                  "new bank account, {month} salary",
                  "Hi, I've switched banks. Will my {month} salary go to the new account?",
                  "update bank details for {month} pay",
                  "When is the deadline to change bank details for {month}?",
              ), "Update your account in Workday under Pay > Payment Elections. Changes made "
                 "by the 15th apply to that month's salary; after the 15th, your {month} "
                 "salary still goes to the old account and the change applies from the next "
                 "month."),
          )),
    Topic("benefits_enrollment",
          "For benefits questions, contact the Benefits team via Ask HR in Workday or on "
          "ext. 3200.",
          (
              Intent("new_hire_enrollment", (
                  "I started on {start_date}. How do I sign up for benefits?",
                  "benefits enrollment, start date {start_date}",
                  "Hello, I joined on {start_date}. What's the deadline to choose my health "
                  "plan?",
                  "started {start_date}, how do i enroll in benefits",
                  "Is it too late to enroll in benefits if I started on {start_date}?",
              ), "You have 30 days from your start date of {start_date} to enroll. In Workday, "
                 "open Benefits > Enroll and choose your medical, dental and vision plans and "
                 "your pension contribution. If you miss the window, you wait for open "
                 "enrollment, 1-15 November."),
              Intent("life_event", (
                  "I {life_event} last month. Can I change my benefits?",
                  "{life_event}, need to update benefits",
                  "Hi, I recently {life_event}. What do I need to do about my benefits?",
                  "just {life_event}, can i change my benefits now or wait till november",
                  "Does it count as a life event if I {life_event}?",
              ), "Yes. Because you {life_event}, you can change your benefits outside open "
                 "enrollment. Within 31 days of the event, go to Workday > Benefits > Change "
                 "Benefits, select the life event and upload proof. Changes apply from the date "
                 "of the event."),
              Intent("change_plan", (
                  "How do I change my {benefit_plan} plan?",
                  "switch {benefit_plan} plan",
                  "Hello, I'd like to change my {benefit_plan} cover. When am I allowed to?",
                  "can i change {benefit_plan} plan mid year",
                  "When can I update my {benefit_plan} benefits?",
              ), "You can change your {benefit_plan} plan once a year during open enrollment, "
                 "1-15 November, in Workday under Benefits > Open Enrollment; changes start on "
                 "1 January. Outside that window you need a qualifying life event, such as "
                 "marriage or a new child."),
          )),
)

ESCALATION = {t.category: t.escalation for t in TOPICS}

# Intents (one per topic) whose unused held-out combinations become the demo prompts.
DEMO_INTENTS = ("forgot_password", "vpn_not_connecting", "submit_expense", "book_leave",
                "report_phishing", "install_software", "flight_class", "work_abroad")


# --------------------------------------------------------------------------------------------
# Building examples
# --------------------------------------------------------------------------------------------

class Example(NamedTuple):
    category: str
    intent: str
    prompt: str
    answer: str


def _rng(seed: int, *parts: str) -> random.Random:
    # String seeds go through SHA-512, so streams are independent of PYTHONHASHSEED, and each
    # (purpose, intent) gets its own stream: editing one intent does not reshuffle the others.
    return random.Random(":".join(map(str, (seed, *parts))))


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _slots(intent: Intent) -> tuple[str, ...]:
    return tuple(sorted(_fields(intent.phrasings[0])))


def _words(*texts: str) -> int:
    return sum(len(t.split()) for t in texts)


def _render(intent: Intent, phrasing: int, values: tuple) -> tuple[str, str]:
    context = dict(zip(_slots(intent), values))
    for slot, value in list(context.items()):
        context.update(DERIVED.get(slot, lambda _: {})(value))
    return intent.phrasings[phrasing].format(**context), intent.answer.format(**context)


def _candidates(intent: Intent) -> list[tuple[int, tuple]]:
    values = itertools.product(*(SLOT_VALUES[s] for s in _slots(intent)))
    return [(p, v) for v in values for p in range(len(intent.phrasings))]


def _split_pools(intent: Intent, seed: int) -> tuple[list, list]:
    """(train-eligible, held-out) candidates: a candidate is held out if its phrasing or any of
    its entity values is held out, so no held-out combination can also occur in train."""
    held_phrasing = _rng(seed, "held-phrasing", intent.name).randrange(len(intent.phrasings))
    slots = _slots(intent)
    train, heldout = [], []
    for phrasing, values in _candidates(intent):
        novel = phrasing == held_phrasing or any(
            v in HELDOUT.get(s, ()) for s, v in zip(slots, values))
        (heldout if novel else train).append((phrasing, values))
    return train, heldout


def _quotas(total: int, n: int) -> list[int]:
    return [total // n + (i < total % n) for i in range(n)]


def _validate_tables() -> None:
    """Fail loudly on table mistakes that would silently make the data unlearnable."""
    longest_system = max(_words(s) for s in SYSTEM_PROMPTS)
    seen: dict[str, tuple] = {}
    for topic in TOPICS:
        for intent in topic.intents:
            slots = set(_slots(intent))
            assert len(intent.phrasings) >= 4, intent.name
            for p in intent.phrasings:  # a phrasing that drops a slot would hide answer content
                assert _fields(p) == slots, (intent.name, p)
            derived = {k for s in slots if s in DERIVED for k in DERIVED[s](SLOT_VALUES[s][0])}
            assert _fields(intent.answer) <= slots | derived, intent.name
            for s in slots:
                assert set(HELDOUT.get(s, ())) < set(SLOT_VALUES[s]), s
            for phrasing, values in _candidates(intent):
                prompt, answer = _render(intent, phrasing, values)
                key = (intent.name, values)
                assert seen.setdefault(prompt, key) == key, f"ambiguous prompt {prompt!r}"
                assert MIN_ANSWER_WORDS <= _words(answer) <= MAX_ANSWER_WORDS, (intent.name, answer)
                assert longest_system + _words(prompt, answer) <= MAX_ROW_WORDS, intent.name


def _make(topic: Topic, intent: Intent, candidates: list) -> list[Example]:
    return [Example(topic.category, intent.name, *_render(intent, p, v)) for p, v in candidates]


def _examples(seed: int) -> tuple[dict[str, list[Example]], list[Example]]:
    """Per-intent sampling: train rows from the train pool, eval rows and demos from the
    held-out pool, in table order."""
    intents = [(t, i) for t in TOPICS for i in t.intents]
    train_q, eval_q = _quotas(TRAIN_ROWS, len(intents)), _quotas(EVAL_ROWS, len(intents))
    splits: dict[str, list[Example]] = {"train": [], "eval": []}
    unused: dict[str, list[Example]] = {}
    for (topic, intent), n_train, n_eval in zip(intents, train_q, eval_q):
        train_pool, heldout_pool = _split_pools(intent, seed)
        assert len(train_pool) >= n_train and len(heldout_pool) > n_eval, intent.name
        rng = _rng(seed, "sample", intent.name)
        picked_train = rng.sample(train_pool, n_train)
        heldout = rng.sample(heldout_pool, len(heldout_pool))
        splits["train"] += _make(topic, intent, picked_train)
        splits["eval"] += _make(topic, intent, heldout[:n_eval])
        unused[intent.name] = _make(topic, intent, heldout[n_eval:])
    # Demos are shown to readers, so prefer a full question over a terse fragment.
    demos = []
    for name in DEMO_INTENTS:
        pool = unused[name]
        demos.append(next((e for e in pool if e.prompt.endswith("?")), pool[0]))
    return splits, demos


def _row(row_id: str, ex: Example, fmt: str, rng: random.Random) -> dict:
    row = {"id": row_id, "category": ex.category}
    if fmt == "prompt":
        return {**row, "prompt": ex.prompt, "response": ex.answer}
    if fmt == "question":
        return {**row, "question": ex.prompt, "answer": ex.answer}
    messages = []
    if rng.random() < SYSTEM_SHARE:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages += [{"role": "user", "content": ex.prompt},
                 {"role": "assistant", "content": ex.answer}]
    if rng.random() < MULTI_TURN_SHARE:
        follow_up = [{"role": "user", "content": rng.choice(FOLLOW_UPS)},
                     {"role": "assistant", "content": ESCALATION[ex.category]}]
        if _words(*(m["content"] for m in messages + follow_up)) <= MAX_ROW_WORDS:
            messages += follow_up
    return {**row, "messages": messages}


def first_user_text(row: dict) -> str:
    """The user's (first) request in any of the three row formats."""
    if "messages" in row:
        return next(m["content"] for m in row["messages"] if m["role"] == "user")
    return row.get("prompt", row.get("question"))


def row_words(row: dict) -> int:
    if "messages" in row:
        return _words(*(m["content"] for m in row["messages"]))
    return _words(*(v for k, v in row.items() if k not in ("id", "category")))


def row_format(row: dict) -> str:
    return next(k for k in ("messages", "prompt", "question") if k in row)


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """All rows: {"train": [...], "eval": [...], "prompts": [{"id", "prompt"}, ...]}."""
    _validate_tables()
    splits, demos = _examples(seed)
    out: dict[str, list[dict]] = {}
    for split, examples in splits.items():
        # Shuffle so topics interleave in training order; formats are then dealt round-robin.
        _rng(seed, "order", split).shuffle(examples)
        rng = _rng(seed, "format", split)
        out[split] = [_row(f"{split}-{i:04d}", ex, FORMAT_CYCLE[i % len(FORMAT_CYCLE)], rng)
                      for i, ex in enumerate(examples)]
    out["prompts"] = [{"id": f"demo-{i:02d}-{ex.category}", "prompt": ex.prompt}
                      for i, ex in enumerate(demos, 1)]

    train_prompts = {first_user_text(r) for r in out["train"]}
    eval_prompts = {first_user_text(r) for r in out["eval"]}
    assert not train_prompts & eval_prompts, "eval prompt leaked into train"
    assert not {p["prompt"] for p in out["prompts"]} & (train_prompts | eval_prompts)
    assert {r["category"] for r in out["eval"]} <= {r["category"] for r in out["train"]}
    ids = [r["id"] for rows in out.values() for r in rows]
    assert len(ids) == len(set(ids))
    assert all(row_words(r) <= MAX_ROW_WORDS for s in ("train", "eval") for r in out[s])
    return out


# --------------------------------------------------------------------------------------------
# Statistics, README and files
# --------------------------------------------------------------------------------------------

def summarize(data: dict[str, list[dict]]) -> dict:
    stats = {}
    for split in ("train", "eval"):
        rows = data[split]
        words = [row_words(r) for r in rows]
        messages = [r["messages"] for r in rows if "messages" in r]
        stats[split] = {
            "rows": len(rows),
            "formats": dict(sorted(Counter(row_format(r) for r in rows).items())),
            "with_system": sum(m[0]["role"] == "system" for m in messages),
            "multi_turn": sum(sum(x["role"] == "user" for x in m) > 1 for m in messages),
            "categories": dict(sorted(Counter(r["category"] for r in rows).items())),
            "words": (min(words), statistics.median(words), max(words)),
            "distinct_prompts": len({first_user_text(r) for r in rows}),
        }
    stats["prompts"] = {"rows": len(data["prompts"])}
    return stats


def format_stats(stats: dict) -> str:
    lines = []
    for split in ("train", "eval"):
        s = stats[split]
        lo, med, hi = s["words"]
        lines += [f"{split}: {s['rows']} rows, {s['distinct_prompts']} distinct prompts, "
                  f"words per row min/median/max {lo}/{med:g}/{hi}",
                  "  formats: " + ", ".join(f"{k} {v}" for k, v in s["formats"].items())
                  + f" (messages: {s['with_system']} with system, {s['multi_turn']} multi-turn)",
                  "  categories: " + ", ".join(f"{k} {v}" for k, v in s["categories"].items())]
    lines.append(f"prompts: {stats['prompts']['rows']} demo prompts")
    return "\n".join(lines)


def _readme(data: dict[str, list[dict]], seed: int) -> str:
    stats = summarize(data)
    tr, ev = stats["train"], stats["eval"]
    held = "\n".join(f"- {slot}: " + ", ".join(map(str, vals)) for slot, vals in HELDOUT.items())
    categories = "\n".join(f"| {c} | {tr['categories'][c]} | {ev['categories'].get(c, 0)} |"
                           for c in tr["categories"])
    return f"""# Data

Synthetic Acme Corp IT/HR helpdesk dataset for the fine-tuning notebooks. Every file here is
written by `lib/distlab/datagen.py` (seed {seed}); do not edit by hand.

| file | rows | content |
|---|---|---|
| `support/train.jsonl` | {tr['rows']} | training split |
| `support/eval.jsonl` | {ev['rows']} | held-out split |
| `prompts/demo_prompts.jsonl` | {stats['prompts']['rows']} | `{{"id", "prompt"}}` user questions for before/after generation demos |

## Row formats

One JSON object per line. Every row has `id` (unique across both splits) and `category`
(one of {len(tr['categories'])} topics) plus exactly one of:

- `prompt` + `response` (train {tr['formats'].get('prompt', 0)}, eval {ev['formats'].get('prompt', 0)})
- `question` + `answer` (train {tr['formats'].get('question', 0)}, eval {ev['formats'].get('question', 0)})
- `messages`: a list of `{{"role": "system"|"user"|"assistant", "content": ...}}`
  (train {tr['formats'].get('messages', 0)}, eval {ev['formats'].get('messages', 0)}). Most start with one of {len(SYSTEM_PROMPTS)} system prompts
  (train {tr['with_system']}, eval {ev['with_system']}); some are two-turn (train {tr['multi_turn']}, eval {ev['multi_turn']}); the last
  message is always the assistant's.

Words per row, all text fields, min/median/max: train {tr['words'][0]}/{tr['words'][1]:g}/{tr['words'][2]}, eval {ev['words'][0]}/{ev['words'][1]:g}/{ev['words'][2]}.
Every row fits a 256-token sequence with a ~4k-vocab BPE tokenizer.

## How it is built

Each topic has intents; each intent has several user phrasings (polite, terse, typo-ish,
question or statement) with entity slots (apps, cities, departments, names, devices, amounts,
dates) and one answer template. The answer depends only on the intent and the entity values,
never on the phrasing, and states concrete policy (for example "within 30 days", "receipts
over $25", "25 days of annual leave", "security hotline on ext. 4444").

## Split

For every intent one phrasing is held out (chosen from the seed), and these entity values
never occur in train:

{held}

Train rows use only seen phrasings and values; eval rows use a held-out phrasing or value (or
both), so no eval prompt text occurs in train, while every eval intent has train rows. The
generator asserts this. Demo prompts are further held-out combinations not used in eval.

| category | train | eval |
|---|---|---|
{categories}

## Regenerate

```bash
python -m distlab.datagen           # rewrite these files
python -m distlab.datagen --check   # exit 1 and name any file that differs
python -m distlab.datagen --stats   # print counts and length statistics
```
"""


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def _file_bytes(seed: int) -> dict[str, bytes]:
    data = generate(seed)
    out = {key: _jsonl(data[key]) for key in ("train", "eval", "prompts")}
    out["readme"] = _readme(data, seed).encode("utf-8")
    return out


def write(out_dir: Path = REPO_ROOT, seed: int = SEED) -> dict[str, Path]:
    """Write all files under out_dir (the repo root by default); returns {key: path}."""
    paths = {}
    for key, content in _file_bytes(seed).items():
        path = Path(out_dir) / FILES[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)  # bytes, so line endings stay "\n" on every platform
        paths[key] = path
    return paths


def check(out_dir: Path = REPO_ROOT, seed: int = SEED) -> list[str]:
    """Relative paths of files that are missing or differ from what `write` would produce."""
    root = Path(out_dir)
    return [FILES[key] for key, content in _file_bytes(seed).items()
            if not (root / FILES[key]).is_file() or (root / FILES[key]).read_bytes() != content]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlab.datagen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT,
                        help="root the data/ paths are relative to (default: the repo root)")
    parser.add_argument("--seed", type=int, default=SEED)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare instead of writing")
    mode.add_argument("--stats", action="store_true", help="print statistics, write nothing")
    args = parser.parse_args(argv)

    if args.stats:
        print(format_stats(summarize(generate(args.seed))))
        return 0
    if args.check:
        differing = check(args.out_dir, args.seed)
        for rel in differing:
            print(f"differs from generator output: {rel}", file=sys.stderr)
        if not differing:
            print("data files are up to date")
        return 1 if differing else 0
    for path in write(args.out_dir, args.seed).values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
